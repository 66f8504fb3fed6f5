"""Command-line front-ends of the library, one module per app, each runnable as ``python -m pipeline.cli.<app>``.

Living in the library (not in ``launch/``) lets code that starts processes name them by module, and keeps the
``launch/`` scripts thin wrappers for users.
"""

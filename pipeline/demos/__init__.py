"""The resumable demos (``make demo``, ``make demo-lm``): a stage runner (``runner``) that runs each stage as the
command a user could type and skips finished ones, the demos' stage lists (``demo``, ``demo_lm``) and their
reports (``demo_report``, ``demo_lm_report``).

May import ``pipeline.data``, ``pipeline.hf``, ``pipeline.evaluation`` and ``pipeline.train``; stages start other
jobs as processes by module name (``python -m pipeline.cli.<app>``).
"""

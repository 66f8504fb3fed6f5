"""GPU readiness: the wheels a bare GPU image lacks (``wheels``) and the one-command GPU check (``cli``, which runs
the ``stages`` under one budget with ``runner`` and commits a finished run's results with ``publish``).

``cli``, ``wheels``, ``stages``, ``runner`` and ``publish`` import only the standard library (and the stdlib-only
``data_prep.redaction``) at import time: ``launch/gpu_check.py`` runs them on a machine where deepspeed, omegaconf
and streaming exist only once the carried wheels are installed. ``kernel_bench``, ``registers`` and
``passkey_probe`` run as stages, after that. ``kernel_compile`` (``make test-gpu-compile``) compiles the Triton
kernels for sm_90/sm_80 on a machine without a GPU; ``registers`` compares its committed table with the kernels a
GPU's own triton compiles.
"""

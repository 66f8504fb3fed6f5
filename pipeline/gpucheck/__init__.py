"""GPU readiness: the wheels a bare GPU image lacks (``wheels``) and the one-command GPU check (``runner``).

Every module here imports only the standard library at import time: ``launch/gpu_check.py`` runs them on a
machine where deepspeed, omegaconf and streaming exist only once the carried wheels are installed.
"""

"""Every Triton kernel compiled for sm_90 and sm_80 without a GPU (``make test-gpu-compile``):
``python launch/gpu_compile.py --out docs/results/gpu-compile.md``.

The command line is ``pipeline.gpucheck.kernel_compile``'s (also runnable as
``python -m pipeline.gpucheck.kernel_compile``).
"""

from data_prep.entry import run
from pipeline.gpucheck.kernel_compile import main

if __name__ == "__main__":
    run(main)

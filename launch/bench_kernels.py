"""The fused Triton GCA kernel vs the naive reference and dense attention (``make bench-kernels``; CUDA only):
``python launch/bench_kernels.py``.

The command line is ``pipeline.bench.kernels``'s (also runnable as ``python -m pipeline.bench.kernels``); its
``--out`` JSON mode is the GPU check's ``kernel_bench`` stage.
"""

import sys

from pipeline.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())

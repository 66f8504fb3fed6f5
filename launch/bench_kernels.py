"""The fused Triton GCA kernel vs the naive reference and dense attention (``make bench-kernels``; CUDA only):
``python launch/bench_kernels.py``.

The command line is ``kernels.bench_gca``'s (also runnable as ``python -m kernels.bench_gca``).
"""

import sys

from kernels.bench_gca import main

if __name__ == "__main__":
    sys.exit(main())

"""The fused Triton GCA kernels vs the naive reference and the fastest exact attention over the same keys
(``make bench-kernels``; CUDA only): ``python launch/bench_kernels.py [--shape B,HQ,H,Q,S,R,D] [--dtype ...]``.

The command line is ``pipeline.bench.kernels``'s (also runnable as ``python -m pipeline.bench.kernels``): its
``--out`` JSON mode is the GPU check's ``kernel_bench`` stage, ``--sweep-tiles`` times the candidate tiles of
every kernel, ``--count-work`` (under ``TRITON_INTERPRET=1``) counts each launch's products and bytes.
"""

from data_prep.entry import run
from pipeline.bench.kernels import main

if __name__ == "__main__":
    run(main)

"""Context parallelism against one rank: per-rank peak memory, step time and bytes sent (``make bench-cp``):
``python launch/bench_cp.py [--lengths 16384 32768 65536] [--cp 2]``.

The command line is ``pipeline.cli.bench_cp``'s (also runnable as ``python -m pipeline.cli.bench_cp``).
"""

from data_prep.entry import run
from pipeline.cli.bench_cp import main

if __name__ == "__main__":
    run(main)

"""A 3-source weighted mixture vs one dataset through the trainer's batches, tokens/s and peak memory
(``make bench-mixture``): ``python launch/bench_mixture.py [--data data/default] [--seq-len 1024] [--batch 16]``.

The command line is ``pipeline.bench.mixture``'s (also runnable as ``python -m pipeline.bench.mixture``).
"""

from data_prep.entry import run
from pipeline.bench.mixture import main

if __name__ == "__main__":
    run(main)

"""Forward throughput and peak memory of a GCA model vs full attention (``make bench``):
``python launch/bench_model.py [--lengths 1024 4096 16384] [--gca-only 65536] [--repeats 2]``.

The command line is ``pipeline.bench.model``'s (also runnable as ``python -m pipeline.bench.model``).
"""

from data_prep.entry import run
from pipeline.bench.model import main

if __name__ == "__main__":
    run(main)

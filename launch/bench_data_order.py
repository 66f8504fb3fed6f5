"""Documents per global batch under each data order, on a PG19-shaped split (``make bench-data-order``):
``python launch/bench_data_order.py [--lengths-from DIR] [--documents 28602] [--seq-len 16384] [--batch 32]``.

The command line is ``pipeline.bench.data_order``'s (also runnable as ``python -m pipeline.bench.data_order``).
"""

from data_prep.entry import run
from pipeline.bench.data_order import main

if __name__ == "__main__":
    run(main)

"""Data prep tokens/s vs a raw SentencePiece batch encode of the same texts (``make bench-prep``):
``python launch/bench_prep.py [--config configs/data/default.yaml] [--procs 1 2] [key=value ...]``.

The command line is ``pipeline.bench.prep``'s (also runnable as ``python -m pipeline.bench.prep``).
"""

from data_prep.entry import run
from pipeline.bench.prep import main

if __name__ == "__main__":
    run(main)

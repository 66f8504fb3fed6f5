"""The trainer's data reader vs the old decompressed-copy path, tokens/s and bytes written (``make bench-reader``):
``python launch/bench_reader.py [--data data/default] [--epochs 2]``.

The command line is ``pipeline.bench.reader``'s (also runnable as ``python -m pipeline.bench.reader``).
"""

from data_prep.entry import run
from pipeline.bench.reader import main

if __name__ == "__main__":
    run(main)

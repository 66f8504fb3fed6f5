"""Passkey eval time and peak RSS vs length (``make bench-eval``): ``python launch/bench_eval.py [--out X.json]``.

The command line is ``pipeline.cli.bench_eval``'s (also runnable as ``python -m pipeline.cli.bench_eval``).
"""

from data_prep.entry import run
from pipeline.cli.bench_eval import main

if __name__ == "__main__":
    run(main)

"""Evaluate a model export: ``python launch/eval.py --checkpoint <export dir> --task ppl|passkey|ruler --out <dir>
[--config <yaml>] [key=value ...]``.

The command line is ``pipeline.cli.eval``'s (also runnable as ``python -m pipeline.cli.eval``).
"""

from data_prep.entry import run
from pipeline.cli.eval import main

if __name__ == "__main__":
    run(main)

"""Prepare a tokenized MDS dataset: ``python launch/prep.py --config configs/data/<name>.yaml [key=value ...]``.

The command line is ``data_prep.cli``'s (also runnable as ``python -m data_prep.cli``).
"""

from data_prep.cli import main
from data_prep.entry import run

if __name__ == "__main__":
    run(main)

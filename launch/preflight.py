"""Check the nodes before a launch: ``[torchrun ...] launch/preflight.py [--gpus-per-node N] --config X [k=v ...]``.

The command line is ``pipeline.cli.preflight``'s (also runnable as ``python -m pipeline.cli.preflight``).
"""

from data_prep.entry import run
from pipeline.cli.preflight import main

if __name__ == "__main__":
    run(main)

"""Sample from a model export: ``python launch/generate.py --checkpoint <export dir> --prompt "Once upon"``.

The command line is ``pipeline.cli.generate``'s (also runnable as ``python -m pipeline.cli.generate``).
"""

from data_prep.entry import run
from pipeline.cli.generate import main

if __name__ == "__main__":
    run(main)

"""One markdown report of evaluation outputs: ``python launch/report.py <eval --out dir> [<dir> ...] [--out
report.md]`` (docs/evaluation.md, "One report of a run's evals").

The command line is ``pipeline.cli.report``'s (also runnable as ``python -m pipeline.cli.report``).
"""

from data_prep.entry import run
from pipeline.cli.report import main

if __name__ == "__main__":
    run(main)

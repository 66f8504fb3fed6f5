"""GCA vs its random-retriever ablation vs the sliding-window model on held-out books, one time-boxed GPU command:
``python launch/demo_lm_gpu.py --books DIR --out DIR [--cpu] [key=value ...]``.

The command line is ``pipeline.cli.demo_lm_gpu``'s. It runs under a bare GPU image's python3, which has no editable
install of this repository, so the repository root is put on ``sys.path`` first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.entry import run  # noqa: E402  (needs the repository root on sys.path)
from pipeline.cli.demo_lm_gpu import main  # noqa: E402  (needs the repository root on sys.path)

if __name__ == "__main__":
    run(main)

"""One command that proves kernels, bf16 training and long eval on a GPU: ``python launch/gpu_check.py --out DIR``.

The command line is ``pipeline.gpucheck.cli``'s. It runs under a bare GPU image's python3, which has no editable
install of this repository, so the repository root is put on ``sys.path`` first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.entry import run  # noqa: E402  (needs the repository root on sys.path)
from pipeline.gpucheck.cli import main  # noqa: E402  (needs the repository root on sys.path)

if __name__ == "__main__":
    run(main)

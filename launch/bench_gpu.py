"""The training step on one GPU, gca / swa / full x plain / ZeRO-1 / FSDP2 (``make bench-gpu``):
``python launch/bench_gpu.py [--micro-batch N] [--out FILE] [--cpu] [key=value ...]``.

The command line is ``pipeline.cli.bench_gpu``'s (also runnable as ``python -m pipeline.cli.bench_gpu``).
"""

from data_prep.entry import run
from pipeline.cli.bench_gpu import main

if __name__ == "__main__":
    run(main)

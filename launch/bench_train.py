"""Training step time of GCA vs sliding window vs full attention, ZeRO-2 vs 1 process, and bf16 gradients summed in
fp32 vs bf16 under DeepSpeed (``make bench-train``): ``python launch/bench_train.py [--lengths 1024 4096 16384]``.

The command line is ``pipeline.cli.bench_train``'s (also runnable as ``python -m pipeline.cli.bench_train``).
"""

from data_prep.entry import run
from pipeline.cli.bench_train import main

if __name__ == "__main__":
    run(main)

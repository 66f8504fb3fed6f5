"""ATen operators per training step, training step time of GCA vs sliding window vs full attention, ZeRO-2 on 2
processes vs 1, and a bf16 run's gradient sums in fp32 vs bf16 under ZeRO-1/2:
``python -m pipeline.cli.bench_train [--lengths 1024 4096 16384] [--repeats N] [--data DIR] [--steps N]
[--compiled]``.

What is measured is described in ``pipeline/bench/train.py``; the results are printed as tables.
"""

from __future__ import annotations

import argparse
import json
import sys

from data_prep.entry import run
from pipeline.bench.train import op_count_table, step_time_table, time_step, zero2_comparison
from pipeline.train.metrics import processor


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and print every part of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--data", default="data/default", help="prepared dataset for the ZeRO-2 comparison")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument(
        "--compiled", action="store_true", help="also count the compiled step's kernels (minutes of compiling)"
    )
    # One (kind, length) timed in this process, its result one JSON line: how each table cell is measured.
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        sys.stdout.write(json.dumps(time_step(args.one[0], int(args.one[1]), args.repeats)) + "\n")
        return 0
    sys.stdout.write(f"measured on a {processor()}\n\n")
    op_count_table(sys.stdout, compiled=args.compiled)
    step_time_table(args.lengths, args.repeats, sys.stdout)
    zero2_comparison(args.data, args.steps, sys.stdout)
    return 0


if __name__ == "__main__":
    run(main)

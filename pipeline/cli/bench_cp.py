"""Context parallelism against one rank: ``python -m pipeline.cli.bench_cp [--lengths 16384 32768 65536] [--cp 2]
[--repeats N]``.

What is measured is described in ``pipeline/bench/cp.py``; the results are printed as one table.
"""

from __future__ import annotations

import argparse
import json
import sys

from data_prep.entry import run
from pipeline.bench.cp import cp_table, run_rank
from pipeline.train.metrics import processor


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--cp", type=int, default=2, help="ranks the sequence is split over (compared with 1)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the first (memory) step")
    # One rank of one (length, cp) measurement, its result one JSON line: how each table cell is measured.
    parser.add_argument("--rank", nargs=2, type=int, metavar=("LENGTH", "CP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cp < 2 or args.repeats < 0 or min(args.lengths) < 1:
        parser.error("--cp must be >= 2, --repeats >= 0 and every length >= 1")
    if args.rank:
        sys.stdout.write(json.dumps(run_rank(args.rank[0], args.rank[1], args.repeats)) + "\n")
        return 0
    sys.stdout.write(f"measured on a {processor()}\n\n")
    cp_table(args.lengths, args.cp, args.repeats, sys.stdout)
    return 0


if __name__ == "__main__":
    run(main)

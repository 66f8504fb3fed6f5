"""Passkey eval time and peak RSS of a tiny random-init model vs length: ``python -m pipeline.cli.bench_eval
[--lengths 16384,65536] [--full-lengths 16384] [--timeout S] [--out bench_eval.json]``.

The models and targets are described in ``pipeline/evaluation/bench.py``; the report is written as JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.evaluation.bench import run_bench


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the benchmark and write its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=_lengths, default="16384,65536,262144,1048576")
    parser.add_argument("--full-lengths", type=_lengths, default="16384,32768")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--out", default="bench_eval.json")
    args = parser.parse_args(argv)
    report = run_bench(args.lengths, args.full_lengths, args.timeout)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

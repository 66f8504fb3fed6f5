"""Passkey eval time and peak RSS of a tiny random-init model vs length: ``python -m pipeline.cli.bench_eval
[--lengths 16384,65536] [--full-lengths 16384] [--timeout S] [--out bench_eval.json]``.

``--per-token [--positions 262144,1048576,4194304] [--window 65536] [--checkpoint EXPORT]``: instead, stream one
passkey prefix once and print tokens/s at each position with its ratio to the first (flat = 1.0), measured in one
run (``run_per_token``).

The models and targets are described in ``pipeline/bench/eval.py``; the report is written as JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from data_prep.entry import run
from data_prep.safe_write import write_text
from pipeline.bench.eval import run_bench, run_per_token
from pipeline.train.metrics import processor


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the benchmark and write its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=_lengths, default="16384,65536,262144,1048576")
    parser.add_argument("--full-lengths", type=_lengths, default="16384,32768")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--out", help="JSON report (default: bench_eval.json, with --per-token bench_per_token.json)")
    parser.add_argument("--per-token", action="store_true", help="tokens/s by position of one streamed prefix")
    parser.add_argument("--positions", type=_lengths, default="262144,1048576,4194304", help="with --per-token")
    parser.add_argument("--window", type=int, default=65536, help="with --per-token: tokens timed before a position")
    parser.add_argument("--segment", type=int, default=4096, help="with --per-token: tokens per streamed step")
    parser.add_argument("--checkpoint", help="with --per-token: an export instead of the tiny random-init model")
    parser.add_argument("--offload-dir", help="with --per-token: where the on-disk chunk store goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # one measured row per line, as it is measured
    if args.per_token:
        report = run_per_token(args.positions, args.window, args.segment, args.checkpoint, args.offload_dir)
        args.out = args.out or "bench_per_token.json"
    else:
        report = run_bench(args.lengths, args.full_lengths, args.timeout)
        args.out = args.out or "bench_eval.json"
    write_text(Path(args.out), json.dumps({"processor": processor(), **report}, indent=2) + "\n")
    logging.getLogger(__name__).info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    run(main)

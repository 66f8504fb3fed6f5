"""The training step on one GPU, gca / swa / full x plain / DeepSpeed ZeRO-1 / FSDP2 (``make bench-gpu``):
``python -m pipeline.cli.bench_gpu [--micro-batch N] [--steps N] [--out FILE] [--cpu] [--agreement N]
[key=value ...]``.

What is measured is described in ``pipeline/bench/train_gpu.py``; ``key=value`` are trainer config overrides
applied to every configuration (e.g. ``train.compile=blocks``). About 8 minutes on one H200 at the defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_prep.entry import run
from data_prep.safe_write import write_text
from data_prep.schema import ConfigError
from pipeline.bench.train_gpu import ARCHS, ENGINES, check_overrides, loss_agreement, measure, run_all


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), measure every configuration and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=0, help="sequences per step (default: the config's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first (median reported)")
    parser.add_argument("--timeout-s", type=float, default=50.0, help="limit per configuration, its process included")
    parser.add_argument("--out", type=Path, default=Path("bench_gpu.json"), help="JSON written here")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU with configs/train/debug.yaml's model")
    parser.add_argument(
        "--agreement", type=int, default=0, metavar="N", help="only compare N steps' losses, eager vs compiled blocks"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    # One configuration measured in this process, its result one JSON line: how each table row is made.
    parser.add_argument("--one", nargs=2, metavar=("ARCH", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad or args.steps < 1 or args.micro_batch < 0 or args.agreement < 0:
        what = (
            f"override {bad[0]!r} is not key=value"
            if bad
            else "--steps must be >= 1, --micro-batch and --agreement >= 0"
        )
        print(f"bench_gpu: {what}", file=sys.stderr)
        return 2
    if args.one:
        arch, engine = args.one
        if arch not in ARCHS or engine not in ENGINES:
            print(f"bench_gpu: --one takes an arch of {ARCHS} and an engine of {tuple(ENGINES)}", file=sys.stderr)
            return 2
        row = measure(arch, engine, args.cpu, args.steps, args.micro_batch, args.overrides)
        sys.stdout.write(json.dumps(row) + "\n")
        return 0
    try:
        check_overrides(args.cpu, args.overrides)
    except ConfigError as err:
        print(f"bench_gpu: {err}", file=sys.stderr)
        return 2
    if args.agreement:
        result = loss_agreement(args.cpu, args.agreement, ["--micro-batch", str(args.micro_batch)], args.timeout_s)
        print(
            f"gca losses over {args.agreement} steps, compiled vs eager: max relative difference "
            f"{result.get('max_rel_diff', result.get('error'))}"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.out, json.dumps(result, indent=1) + "\n")
        return 0
    child = ["--steps", str(args.steps), "--micro-batch", str(args.micro_batch), *args.overrides]
    run_all(args.cpu, child, args.timeout_s, args.out)
    return 0


if __name__ == "__main__":
    run(main)

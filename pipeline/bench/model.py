"""Forward throughput and peak memory of a GCA model vs the same-size full-attention baseline ``model.arch=full``
(``make bench``).

Every measurement runs in a fresh subprocess so that the peak resident memory (``ru_maxrss``) belongs to that
configuration alone; results are printed as ratios against the baseline measured in the same run.
Usage: ``python -m pipeline.bench.model [--lengths 1024 4096 16384] [--gca-only 65536] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from kernels.cpu_math import flush_denormals
from model.archs import build_model
from model.lm import CausalLM
from model.presets import preset
from pipeline.train.metrics import processor

BENCH_CONFIG = preset("bench")


def bench_model(arch: str) -> CausalLM:
    """The benchmark's model of architecture ``arch`` (``model.arch``: ``gca``, ``swa`` or ``full``)."""
    return build_model(preset("bench", arch=arch))


def _measure(kind: str, length: int, repeats: int) -> dict:
    flush_denormals()  # as the trainer and the eval jobs do
    torch.manual_seed(0)
    model = bench_model(kind).eval()
    ids = torch.randint(0, BENCH_CONFIG.vocab_size, (1, length))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    return {"kind": kind, "length": length, "tokens_per_s": length / min(times), "peak_mb": peak_mb}


def _run_isolated(kind: str, length: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "pipeline.bench.model", "--one", kind, str(length), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"kind": kind, "length": length, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--gca-only", type=int, nargs="*", default=[65536])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        sys.stdout.write(json.dumps(_measure(args.one[0], int(args.one[1]), args.repeats)) + "\n")
        return
    n_params = bench_model("gca").num_parameters()
    sys.stdout.write(f"GCA model: {n_params / 1e6:.1f}M parameters, {BENCH_CONFIG}\n")
    sys.stdout.write(
        f"measured on a {processor()}: torch {torch.__version__}, {torch.get_num_threads()} threads, forward only, "
        "batch 1\n\n"
    )
    columns = [("T", 7), ("GCA tok/s", 10), ("full tok/s", 10), ("speed ratio", 11), ("GCA MB", 8), ("full MB", 8)]
    header = " | ".join(f"{name:>{width}}" for name, width in [*columns, ("mem ratio", 9)])
    sys.stdout.write(header + "\n" + "-" * len(header) + "\n")
    for length in args.lengths + args.gca_only:
        gca = _run_isolated("gca", length, args.repeats)
        full = _run_isolated("full", length, args.repeats) if length in args.lengths else None
        if "error" in gca:
            sys.stdout.write(f"{length:>7} | GCA failed: {gca['error']}\n")
            continue
        if full is None or "error" in full:
            sys.stdout.write(
                f"{length:>7} | {gca['tokens_per_s']:>10.0f} | {'-':>10} | {'-':>11} | "
                f"{gca['peak_mb']:>8.0f} | {'-':>8} | {'-':>9}\n"
            )
            continue
        sys.stdout.write(
            f"{length:>7} | {gca['tokens_per_s']:>10.0f} | {full['tokens_per_s']:>10.0f} | "
            f"{gca['tokens_per_s'] / full['tokens_per_s']:>10.2f}x | {gca['peak_mb']:>8.0f} | "
            f"{full['peak_mb']:>8.0f} | {gca['peak_mb'] / max(full['peak_mb'], 1e-9):>8.2f}x\n"
        )


if __name__ == "__main__":
    main()

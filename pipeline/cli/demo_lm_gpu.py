"""GCA, its random-retriever ablation and the sliding-window model trained on books and scored on held-out books
with growing context, in one time-boxed command on one CUDA GPU:
``python launch/demo_lm_gpu.py --books DIR --out DIR [--config configs/demo_lm_gpu/gpu.yaml] [key=value ...]``.

``--books`` is a folder of ``gutenberg-*.tar.xz`` shards of ``<id>.txt`` books. The stages are described in
``pipeline/gpucheck/demo_lm_gpu.py``; ``--cpu`` runs them at tiny shapes (``configs/demo_lm_gpu/cpu.yaml``) without
CUDA. Writes ``DIR/demo-lm-gpu.json``, ``DIR/results.md``, ``DIR/ppl.png`` and ``DIR/demo-lm-gpu.log``. Exit status:
0 every stage ok, 1 a stage did not finish ok (the outputs hold what did), 2 bad arguments or config, before any
work (one line). Missing pinned packages are installed from ``--wheels`` first, as ``make gpu-check`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

from data_prep.entry import run
from pipeline.demos.books import BooksError, choose_holdout, scan
from pipeline.gpucheck.cli import ROOT, install_wheels, missing_packages

GPU_CONFIG = "configs/demo_lm_gpu/gpu.yaml"
CPU_CONFIG = "configs/demo_lm_gpu/cpu.yaml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--books", required=True, help="folder of gutenberg-*.tar.xz book shards")
    parser.add_argument("--out", required=True, help="folder for demo-lm-gpu.json, results.md, ppl.png and the log")
    parser.add_argument("--config", help=f"experiment config (default {GPU_CONFIG}; with --cpu {CPU_CONFIG})")
    parser.add_argument("--cpu", action="store_true", help="the tiny-shape dry run on CPU, even where CUDA is present")
    parser.add_argument("--budget-s", type=float, help="whole-run budget in seconds (default: the config's budget_s)")
    parser.add_argument(
        "--work", help="empty folder for books, data, models and stage logs (default: a temp dir, removed at the end)"
    )
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="carried wheels (make gpu-wheels)")
    parser.add_argument(
        "--site", default=os.path.join(tempfile.gettempdir(), "gca-gpu-site"), help="where the wheels are installed"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the experiment config")
    return parser.parse_args(argv)


def check_paths(args: argparse.Namespace) -> str | None:
    """One line naming the bad argument, before anything runs."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a directory"
    if args.work and Path(args.work).exists() and any(Path(args.work).iterdir()):
        return f"--work {args.work} is not empty; give a new directory (training would resume old runs)"
    if args.budget_s is not None and args.budget_s <= 0:
        return f"--budget-s {args.budget_s} must be > 0"
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), check everything, run every stage; returns the exit code."""
    args = parse_args(argv)
    error = check_paths(args)
    if error is None:
        try:
            books = scan(Path(args.books))  # reads every shard through: a corrupt one fails here, not minutes later
        except BooksError as err:
            error = str(err)
    if error is None and (missing := missing_packages()):
        error = install_wheels(Path(args.wheels), Path(args.site), missing)
    if error:
        print(f"demo-lm-gpu: error: {error}", file=sys.stderr)
        return 2
    import torch  # after the cheap checks: its import takes seconds

    from data_prep.schema import ConfigError
    from pipeline.gpucheck.demo_lm_gpu import load_config, run_experiment
    from pipeline.gpucheck.stages import Plan

    if not args.cpu and not torch.cuda.is_available():
        print(
            "demo-lm-gpu: error: no CUDA device: this experiment needs a GPU; --cpu runs its tiny-shape dry run",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = load_config(args.config or (CPU_CONFIG if args.cpu else GPU_CONFIG), args.overrides)
        holdout = choose_holdout(
            books, cfg.holdout, cfg.holdout_min_bytes, cfg.holdout_long, cfg.holdout_long_min_bytes, cfg.seed
        )
    except (ConfigError, BooksError) as err:
        print(f"demo-lm-gpu: error: {err}", file=sys.stderr)
        return 2
    budget = args.budget_s or cfg.budget_s
    experiment = {
        "models": cfg.models,
        "books": {"folder": str(args.books), "count": len(books), "bytes": sum(b.bytes for b in books.values())},
        "holdout": holdout,
        "config": dataclasses.asdict(cfg),
    }
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gca-demo-lm-gpu-"))
    plan = Plan(cuda=not args.cpu, work=work, python=sys.executable)
    try:
        report = run_experiment(plan, cfg, Path(args.books), Path(args.out), experiment, budget)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)  # the temp dir this run created, nothing else
    print(f"demo-lm-gpu: {Path(args.out) / 'results.md'}")
    return 0 if not report["summary"]["stages_not_ok"] else 1


if __name__ == "__main__":
    run(main)

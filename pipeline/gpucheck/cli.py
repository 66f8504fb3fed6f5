"""One command that proves kernels, bf16 training and long eval on a GPU: ``python launch/gpu_check.py --out DIR``
(or ``python -m pipeline.gpucheck.cli --out DIR``).

On CUDA it runs, each stage time-boxed inside ``--budget-s`` (default 450 s): data prep of the built-in corpus,
the GCA kernel benchmark, ``pytest -m gpu``, bf16 training of ``configs/train/gca_pg19_16k.yaml`` with DeepSpeed
ZeRO-1 and FSDP2 plus the sliding-window and full-attention models, and a 1M-token passkey eval. Without CUDA
(or with ``--cpu``) the same stages run at tiny shapes as a dry run. Writes ``DIR/gpu-check.json`` and
``DIR/gpu-check.log``; exit code 0 when every stage is ok, 1 otherwise, 2 for bad arguments.

Packages the machine lacks (``configs/gpu/wheels.txt``) are installed first from ``--wheels`` (default ``.whl``,
made by ``make gpu-wheels``) with ``pip install --no-index --no-deps --target --site``; the script then restarts
itself with ``--site`` on ``PYTHONPATH`` so every stage sees them.

Around a device run, in the checkout: ``--stamp`` (before) writes the code's commit into the carried wheel folder,
since the device gets the working tree without ``.git``; ``--publish DIR/gpu-check.json`` (after) commits the
results as ``docs/results/gpu/<date>-<machine>.json`` and the table in ``docs/gpu-check.md``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.gpucheck import wheels
from pipeline.gpucheck.stages import DEFAULT_CUDA_BUDGET_S

ROOT = Path(__file__).resolve().parents[2]

REEXEC = "GCA_GPU_CHECK_SITE"


def missing_packages() -> list[str]:
    """Pinned packages of configs/gpu/wheels.txt that this interpreter does not have at the pinned version."""
    missing = []
    for pin in wheels.read_pins():
        try:
            if md.version(pin.name) != pin.version:
                missing.append(f"{pin.name}=={pin.version}")
        except md.PackageNotFoundError:
            missing.append(f"{pin.name}=={pin.version}")
    return missing


PIP_INSTALL_INTO = (
    "-m",
    "pip",
    "install",
    "-q",
    "--no-index",
    "--no-deps",
    "--no-compile",
    "--no-cache-dir",
    "--upgrade",
    "--target",
)
"""``python`` + these + a folder + the wheels: the offline install of the carried wheels into their own folder."""


def install_wheels(wheel_dir: Path, site: Path, missing: list[str]) -> str | None:
    """Install the carried wheels and restart with them on PYTHONPATH; returns an error line, or never returns."""
    if os.environ.get(REEXEC):
        return f"still missing after installing {wheel_dir}: {', '.join(missing)}; rerun `make gpu-wheels`"
    found = sorted(wheel_dir.glob("*.whl"))
    if not found:
        return (
            f"missing {', '.join(missing)} and no wheels in {wheel_dir}: run `make gpu-wheels` on a machine "
            "with pip access and carry .whl"
        )
    print(f"gpu-check: installing {len(found)} wheels from {wheel_dir} into {site}", flush=True)
    done = subprocess.run(
        [sys.executable, *PIP_INSTALL_INTO, str(site), *map(str, found)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        return f"pip install of {wheel_dir} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    path = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONPATH": path, REEXEC: str(site)})
    return None  # unreachable: execve replaced this process


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the bad argument and the fix, before anything runs."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a directory"
    if args.budget_s <= 0 or args.steps < 3:
        return f"--budget-s {args.budget_s} must be > 0 and --steps {args.steps} >= 3"
    if args.export and not (Path(args.export) / "config.json").is_file():
        return f"--export {args.export} is not a model export (no config.json); give e.g. runs/demo/gca/long/export"
    if args.data and not (Path(args.data) / "_COMPLETE").is_file():
        return f"--data {args.data} is not a complete prepared dataset (no _COMPLETE); run launch/prep.py first"
    if args.work and Path(args.work).exists() and any(Path(args.work).iterdir()):
        return f"--work {args.work} is not empty; give a new directory (training would resume old runs)"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--budget-s`` stays None until ``main`` knows whether CUDA is there."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for gpu-check.json and gpu-check.log")
    parser.add_argument("--cpu", action="store_true", help="the tiny-shape dry run even when CUDA is present")
    parser.add_argument("--budget-s", type=float, default=None, help="whole-run budget (CUDA 450, CPU 900)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run on CUDA (CPU: 4)")
    parser.add_argument("--export", help="export for the passkey stage (default: the ZeRO-1 run's export)")
    parser.add_argument("--data", help="a prepared dataset to use instead of preparing one")
    parser.add_argument(
        "--work", help="empty directory for data, runs and stage logs (default: a temp dir, removed at the end)"
    )
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="carried wheels (make gpu-wheels)")
    parser.add_argument(
        "--site", default=os.path.join(tempfile.gettempdir(), "gca-gpu-site"), help="where the wheels are installed"
    )
    parser.add_argument(
        "--stamp", action="store_true", help="write the checkout's commit into --wheels (before carrying) and stop"
    )
    parser.add_argument("--publish", help="a finished run's gpu-check.json: write it and its table into docs/")
    parser.add_argument("--results-dir", default=str(ROOT / "docs/results/gpu"), help="--publish: JSON folder")
    parser.add_argument("--docs", default=str(ROOT / "docs/gpu-check.md"), help="--publish: the page for the table")
    return parser.parse_args(argv)


def stamp(wheel_dir: Path) -> int:
    from pipeline.gpucheck.runner import STAMP_NAME, write_stamp

    try:
        source = write_stamp(wheel_dir / STAMP_NAME)
    except (RuntimeError, OSError) as err:
        print(f"gpu-check: error: --stamp: {err}", file=sys.stderr)
        return 2
    dirty = f", plus {source['changed_files']} changed tracked files" if source["dirty"] else ""
    print(f"gpu-check: stamped {wheel_dir / STAMP_NAME}: commit {source['commit']}{dirty}; carry {wheel_dir}")
    return 0


def publish(args: argparse.Namespace) -> int:
    from pipeline.gpucheck.publish import PublishError
    from pipeline.gpucheck.publish import publish as write

    try:
        target, table = write(Path(args.publish), Path(args.results_dir), Path(args.docs))
    except PublishError as err:
        print(f"gpu-check: error: --publish: {err}", file=sys.stderr)
        return 2
    print(table, end="")
    print(f"gpu-check: wrote {target} and the table in {args.docs}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), install missing wheels, run every stage; returns the exit code."""
    args = parse_args(argv)
    if args.stamp:
        return stamp(Path(args.wheels))
    if args.publish:
        return publish(args)
    if not args.out:
        print("gpu-check: error: --out DIR is required (or --stamp, or --publish FILE)", file=sys.stderr)
        return 2
    missing = missing_packages()
    if missing:
        error = install_wheels(Path(args.wheels), Path(args.site), missing)
        print(f"gpu-check: error: {error}", file=sys.stderr)
        return 2
    import torch  # after the wheel check: its import takes seconds, and a missing-wheel error should not wait

    cuda = torch.cuda.is_available() and not args.cpu
    if args.budget_s is None:
        args.budget_s = DEFAULT_CUDA_BUDGET_S if cuda else 900.0
    error = check_args(args)
    if error:
        print(f"gpu-check: error: {error}", file=sys.stderr)
        return 2
    from pipeline.gpucheck.runner import STAMP_NAME, run_check
    from pipeline.gpucheck.stages import Plan

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gca-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = Plan(
        cuda=cuda,
        work=work,
        python=sys.executable,
        export=args.export,
        data=Path(args.data) if args.data else None,
        steps=args.steps,
        stamp=Path(args.wheels) / STAMP_NAME,
    )
    try:
        report = run_check(plan, Path(args.out), args.budget_s)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)  # the temp dir this run created, nothing else
    print(f"gpu-check: {Path(args.out) / 'gpu-check.json'}")
    return 0 if not report["summary"]["stages_not_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

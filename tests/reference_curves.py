"""Reference loss curves: ``configs/train/debug.yaml`` for 20 steps on a slice of the built-in corpus, per engine.

The curves in ``tests/assets/reference_curves.json`` pin the training numerics across commits: a change that moves
them is a numerics change and says why (DEVELOPERS.md), or it is a bug. Each engine is launched the way users
launch it (``launch/pretrain.py`` in one process, under torchrun with FSDP2, under the DeepSpeed launcher with
ZeRO-2, 2 ranks each over gloo) and compared with its own stored curve.

The corpus is the built-in one (the Python standard library's source) restricted to the 40 files whose path starts
with ``a`` (``exclude=["[!a]*"]``: 37 train / 3 val documents, ~171K tokens, prepared in ~7 s, tokenizer trained on
it). Its content depends on the Python patch release, so the stored curves record the input's sha256 and the test
refuses a different corpus with the command that regenerates them.

Tolerance: each step's loss within ``RTOL`` = 1e-5 relative of the stored one. Measured on the development machine
(2 cores): a rerun is bitwise identical; 2 intra-op threads instead of 1 move a curve by at most 7.1e-8; capping the
CPU kernels at SSE4.1 (``ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE``, the summation
orders of another CPU) by at most 7.1e-8. One-line numerics changes move it far more: ``model.init_std`` +1%
8.5e-5, ``optim.eps`` 1e-8 -> 1e-7 6.8e-5, ``model.norm_eps`` 1e-5 -> 1e-6 2.0e-4, ``optim.lr`` +1% 1.9e-3.

Regenerate (after a deliberate numerics change): ``make reference-curves``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "tests" / "assets" / "reference_curves.json"
CONFIG = "configs/train/debug.yaml"
RTOL = 1e-5
# val_unit=documents: the curves were made with 3 whole documents held out (val_unit=auto would take tails here)
CORPUS_OVERRIDES = [
    "input=builtin:python_stdlib",
    'exclude=["[!a]*"]',
    "val_fraction=0.1",
    "val_unit=documents",
    "progress=false",
]
ENGINES: dict[str, list[str]] = {
    "single": ["parallel.engine=none"],
    "fsdp2_2ranks": ["parallel.engine=fsdp"],
    "deepspeed_zero2_2ranks": ["parallel.engine=deepspeed", "parallel.zero_stage=2"],
}
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def prepare_corpus(out: Path) -> str:
    """Prepare the corpus slice into ``out`` with ``launch/prep.py``; returns the input's sha256 from the manifest."""
    cmd = [sys.executable, "launch/prep.py", "--config", "configs/data/default.yaml", f"output={out}"]
    subprocess.run(cmd + CORPUS_OVERRIDES, check=True, capture_output=True, timeout=TIMEOUT_S, cwd=REPO, env=_env())
    manifest = json.loads((out / "manifest.json").read_text())
    return str(manifest["inputs"][0]["sha256"])


def launcher(engine: str) -> list[str]:
    """The command prefix a user types for ``engine``."""
    if engine == "single":
        return [sys.executable]
    if engine.startswith("deepspeed"):
        return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]


def train(engine: str, data: Path, run_dir: Path, extra: Sequence[str] = ()) -> list[float]:
    """Run the debug config under ``engine`` and return its per-step training losses (steps 1..max_steps).

    Raises:
        RuntimeError: the run failed (its output is in the message).
    """
    args = ["launch/pretrain.py", "--config", CONFIG, f"data.path={data}", f"run_dir={run_dir}", *ENGINES[engine]]
    done = subprocess.run(
        launcher(engine) + args + list(extra), capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=_env()
    )
    if done.returncode != 0:
        raise RuntimeError(f"{engine} run failed (exit {done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    losses: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "loss" in record:
            losses[int(record["step"])] = float(record["loss"])
    return [losses[step] for step in sorted(losses)]


def mismatches(reference: Sequence[float], losses: Sequence[float], rtol: float = RTOL) -> list[str]:
    """One line per step whose loss is off by more than ``rtol`` relative (or a length mismatch)."""
    if len(reference) != len(losses):
        return [f"{len(losses)} steps, the reference has {len(reference)}"]
    return [
        f"step {step}: loss {got:.8f}, reference {want:.8f} (relative {abs(got - want) / abs(want):.1e} > {rtol:.0e})"
        for step, (want, got) in enumerate(zip(reference, losses), start=1)
        if abs(got - want) > rtol * abs(want)
    ]


def load_reference() -> dict:
    return json.loads(ASSET.read_text())


def write_reference(work: Path) -> dict:
    """Regenerate ``ASSET``: prepare the corpus, run every engine, store the curves."""
    sha = prepare_corpus(work / "data")
    curves = {engine: train(engine, work / "data", work / engine) for engine in ENGINES}
    reference = {
        "config": CONFIG,
        "corpus": {"prep_overrides": CORPUS_OVERRIDES, "input_sha256": sha, "python": sys.version.split()[0]},
        "rtol": RTOL,
        "curves": curves,
    }
    ASSET.parent.mkdir(parents=True, exist_ok=True)
    ASSET.write_text(json.dumps(reference, indent=1) + "\n")
    return reference


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory for the corpus and the runs")
    args = parser.parse_args(argv)
    reference = write_reference(args.work)
    for engine, curve in reference["curves"].items():
        print(f"{engine}: {len(curve)} steps, loss {curve[0]:.4f} -> {curve[-1]:.4f}")
    print(f"wrote {ASSET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

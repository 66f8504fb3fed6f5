"""The stages of ``make gpu-check``: what each runs on CUDA and at tiny shapes on CPU, and what it measures.

Every stage is one subprocess of this repository's command lines, started by module name (``python -m
data_prep.cli`` for prep, ``python -m pipeline.cli.train``, ``pytest -m gpu``, the JSON kernel benchmark and
passkey probe of this package), so a crash, hang or CUDA error in one stage never takes down the others.
``parse`` turns a finished stage's files into its numbers and raises ``StageError`` when they show a failure the
exit code does not (a NaN loss, a missing result).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIG = "configs/train/gca_pg19_16k.yaml"
DATA_CONFIG = "configs/data/default.yaml"
PREP_MODULE = "data_prep.cli"
TRAIN_MODULE = "pipeline.cli.train"
VOCAB = 4096  # the built-in corpus's tokenizer (configs/data/default.yaml); the paper config says 32000


class StageError(RuntimeError):
    """A stage exited 0 but its outputs show a failure; the message says which."""


@dataclass
class Stage:
    name: str
    what: str
    cmd: list[str]
    box_s: float
    parse: Callable[[], dict]
    needs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    """Where a run writes and how big it is: ``cuda`` = the real check, else the CPU dry run's tiny shapes."""

    cuda: bool
    work: Path
    python: str
    export: str | None = None
    """A model export for the passkey stage (e.g. the demo's); default: the ZeRO-1 stage's export."""
    data: Path | None = None
    """A prepared dataset to train on; default: prepared by the prep stage into ``work/data``."""
    steps: int = 30
    dataset: Path = field(init=False)
    """The dataset the training stages read: ``data``, or where the prep stage writes."""

    def __post_init__(self) -> None:
        self.dataset = self.data or self.work / "data"


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise StageError(f"{path.name} was not written")
    return path.read_text()


def _read_json(path: Path) -> dict:
    return json.loads(_read_text(path))


def gpu_test_files() -> list[str]:
    """Test files that carry the ``gpu`` marker (collecting only them keeps the tier's imports to its own)."""
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def _junit_counts(path: Path) -> dict:
    text = _read_text(path)
    head = re.search(r"<testsuite [^>]*>", text)
    if head is None:
        raise StageError(f"{path.name} holds no <testsuite>")
    attrs = dict(re.findall(r'(\w+)="([^"]*)"', head.group(0)))
    counts = {k: int(attrs.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*>\s*<(?:failure|error)', text)
    return {**counts, "failed_tests": failed[:20]}


def prep_stage(plan: Plan) -> Stage:
    cmd = [
        plan.python,
        "-m",
        PREP_MODULE,
        "--config",
        DATA_CONFIG,
        f"output={plan.dataset}",
        f"num_proc={max(1, min(os.cpu_count() or 1, 16))}",
        "progress=false",
    ]
    if plan.data is not None:
        cmd = [plan.python, "-c", f"print('using the prepared dataset {plan.dataset}')"]

    def parse() -> dict:
        manifest = _read_json(plan.dataset / "manifest.json")
        splits = manifest.get("splits", {})
        return {f"{split}_tokens": splits.get(split, {}).get("tokens") for split in ("train", "val")}

    return Stage(
        "prep",
        "the built-in corpus (Python stdlib) -> SentencePiece 4096 -> MDS shards",
        cmd,
        120 if plan.cuda else 240,
        parse,
    )


def kernel_stage(plan: Plan) -> Stage:
    out = plan.work / "kernel_bench.json"
    cmd = [plan.python, "-m", "pipeline.bench.kernels", "--out", str(out)] + ([] if plan.cuda else ["--tiny"])
    what = (
        "fused GCA fwd and fwd+bwd vs naive vs FlashAttention on the flattened R*S keys "
        "(B=512 HQ=12 Q=64 S=64 R=8 D=64 bf16)"
        if plan.cuda
        else "the same at tiny fp32 shapes, interpreter"
    )
    env = {} if plan.cuda else {"TRITON_INTERPRET": "1"}  # read when the kernels module is imported
    return Stage("kernel_bench", what, cmd, 120 if plan.cuda else 180, lambda: _read_json(out), env=env)


def gpu_tests_stage(plan: Plan) -> Stage:
    junit = plan.work / "gpu-tests.xml"
    cmd = [
        plan.python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        f"--junitxml={junit}",
        *gpu_test_files(),
    ]
    what = "pytest -m gpu: kernels natively in bf16/fp16/fp32, GPU sliding window, model-level Triton vs reference"
    if not plan.cuda:
        what += " (no CUDA: the tier collects and skips itself)"
    return Stage("gpu_tests", what, cmd, 180 if plan.cuda else 120, lambda: _junit_counts(junit))


TINY_MODEL = [
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.ffn_hidden=128",
    "model.n_lower_layers=1",
    "model.groups=[1]",
    "model.n_encoder_layers=1",
    "model.chunk_size=16",
    "model.top_k=2",
    "model.window=32",
    "train.seq_len=256",
    "precision.dtype=auto",
]
TRAIN_VARIANTS = {
    # name: (engine overrides, model overrides, what)
    "train_gca_zero1": (["parallel.engine=deepspeed", "parallel.zero_stage=1"], [], "GCA, DeepSpeed ZeRO-1"),
    "train_gca_fsdp2": (["parallel.engine=fsdp", "parallel.zero_stage=0"], [], "GCA, FSDP2"),
    "train_swa_zero1": (
        ["parallel.engine=deepspeed", "parallel.zero_stage=1"],
        ["model.arch=swa"],
        "same-size sliding-window model (model.arch=swa), DeepSpeed ZeRO-1",
    ),
    "train_full_zero1": (
        ["parallel.engine=deepspeed", "parallel.zero_stage=1"],
        ["model.arch=full"],
        "same-size full-attention transformer (model.arch=full), DeepSpeed ZeRO-1",
    ),
}


def train_metrics(run_dir: Path) -> dict:
    """Throughput, MFU, peak memory and the loss curve of one run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in _read_text(path).splitlines() if ln.strip()]
    rows = [r for r in rows if "loss" in r and "step" in r]
    if not rows:
        raise StageError("metrics.jsonl has no training steps")
    losses = [r["loss"] for r in rows]
    steady = rows[2:] or rows  # the first steps pay for compilation and allocator warm-up
    third = max(1, len(losses) // 3)
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    numbers = {
        "steps": len(rows),
        "tokens_per_step": rows[0].get("tokens"),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "mfu_sparse_aware": statistics.median(mfu) if mfu else None,
        "peak_mem_gb": max(r.get("mem_gb", 0.0) for r in rows),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
        "loss_finite": all(math.isfinite(x) for x in losses),
        "loss_falling": statistics.fmean(losses[-third:]) < statistics.fmean(losses[:third]),
    }
    if not numbers["loss_finite"]:
        raise StageError(f"non-finite loss in {path}: {losses}")
    return numbers


def train_stage(plan: Plan, name: str) -> Stage:
    engine, model, what = TRAIN_VARIANTS[name]
    run_dir = plan.work / "train" / name
    shape = [] if plan.cuda else TINY_MODEL
    steps = plan.steps if plan.cuda else 4
    export = "true" if name == "train_gca_zero1" else "false"  # the passkey stage reads this export
    cmd = [
        plan.python,
        "-m",
        TRAIN_MODULE,
        "--config",
        TRAIN_CONFIG,
        f"run_dir={run_dir}",
        f"data.path={plan.dataset}",
        f"model.vocab_size={VOCAB}",
        *shape,
        *model,
        *engine,
        f"train.max_steps={steps}",
        "train.micro_batch=1",
        "train.global_batch=1",
        "train.eval_every=0",
        "schedule.warmup_steps=3",
        "checkpoint.every=0",
        f"checkpoint.export={export}",
        "logging.every=1",
        "logging.progress=false",
        "logging.wandb=false",
    ]
    what = f"{what}, {'bf16, seq 16380, activation checkpointing' if plan.cuda else 'tiny fp32 model, seq 256'}"
    env = {} if plan.cuda else {"DS_ACCELERATOR": "cpu"}
    return Stage(name, what, cmd, 120 if plan.cuda else 240, lambda: train_metrics(run_dir), ("prep",), env)


def passkey_stage(plan: Plan) -> Stage:
    out = plan.work / "passkey"
    export = plan.export or str(plan.work / "train" / "train_gca_zero1" / "export")
    length = 1_048_576 if plan.cuda else 65_536
    cmd = [
        plan.python,
        "-m",
        "pipeline.gpucheck.passkey_probe",
        "--checkpoint",
        export,
        "--out",
        str(out),
        f"lengths=[{length}]",
        "samples=1",
        "depths=[0.5]",
        "data=builtin",
        "progress=false",
        f"device={'cuda' if plan.cuda else 'cpu'}",
        f"offload_mb={-1 if plan.cuda else 1024}",
    ]
    what = f"passkey at {length:,} tokens with {'the carried export' if plan.export else 'the ZeRO-1 run export'}"

    def parse() -> dict:
        probe = _read_json(out / "probe.json")
        row = probe["rows"][0]
        return {
            "length": row.get("length"),
            "accuracy": row.get("accuracy"),
            "tokens_per_s": row.get("tokens_per_s"),
            "seconds": row.get("seconds"),
            "peak_gpu_mib": probe.get("peak_gpu_mib"),
            "peak_rss_mib": probe.get("peak_rss_mib"),
            "export": export,
            "accuracy_meaningful": bool(plan.export),
        }

    needs = () if plan.export else ("train_gca_zero1",)
    return Stage("passkey", what, cmd, 150 if plan.cuda else 180, parse, needs)


def build(plan: Plan) -> list[Stage]:
    """The stages in the order they run: the cheapest proofs first, so a short budget still returns them."""
    stages = [prep_stage(plan), kernel_stage(plan), gpu_tests_stage(plan), train_stage(plan, "train_gca_zero1")]
    stages += [
        train_stage(plan, "train_gca_fsdp2"),
        train_stage(plan, "train_swa_zero1"),
        passkey_stage(plan),
        train_stage(plan, "train_full_zero1"),
    ]
    return stages


def _loss_agreement(results: dict[str, dict], name: str, reference: str) -> float | None:
    """Largest relative difference between two runs' losses over the steps both logged: the same config, seed and
    data under two engines should train the same model (in bf16 they drift apart by rounding as steps go on)."""
    runs = [results.get(n, {}) for n in (name, reference)]
    if any(r.get("status") != "ok" for r in runs):
        return None
    got, ref = (r["numbers"]["losses"] for r in runs)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def summary(results: dict[str, dict]) -> dict:
    """Ratios across stages: GCA vs SWA vs full-attention step time (same engine), the kernel targets."""

    def step(name: str) -> float | None:
        res = results.get(name, {})
        return res.get("numbers", {}).get("step_time_s") if res.get("status") == "ok" else None

    gca, swa, full = step("train_gca_zero1"), step("train_swa_zero1"), step("train_full_zero1")
    kernel = results.get("kernel_bench", {}).get("numbers", {})
    return {
        "fsdp2_vs_zero1_loss_max_rel_diff": _loss_agreement(results, "train_gca_fsdp2", "train_gca_zero1"),
        "gca_vs_swa_step_time": gca / swa if gca and swa else None,
        "gca_vs_full_step_time": gca / full if gca and full else None,
        "kernel_speedup_vs_naive_fwd_bwd": kernel.get("speedup_vs_naive", {}).get("fwd_bwd"),
        "kernel_time_vs_flash_fwd_bwd": kernel.get("time_vs_flash", {}).get("fwd_bwd"),
        "stages_ok": sorted(n for n, r in results.items() if r.get("status") == "ok"),
        "stages_not_ok": sorted(n for n, r in results.items() if r.get("status") != "ok"),
    }

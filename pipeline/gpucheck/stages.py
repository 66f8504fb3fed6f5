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
    """The most this stage may run; on CUDA the box is also its line in docs/gpu-check.md's budget table."""
    parse: Callable[[], dict]
    needs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    expect_s: float = 0.0
    """What this stage is expected to take (the budget arithmetic); the runner keeps this much of the budget for
    it while an earlier stage runs, so one hang cannot starve the stages after it. 0: nothing kept."""


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
    steps: int = 20
    stamp: Path | None = None
    """The source stamp (``--stamp``) to read the code's commit from where the checkout has no ``.git``."""
    dataset: Path = field(init=False)
    """The dataset the training stages read: ``data``, or where the prep stage writes."""

    def __post_init__(self) -> None:
        self.dataset = self.data or self.work / "data"


DEFAULT_CUDA_BUDGET_S = 450.0
"""The whole check on CUDA: 450 s of one 600 s device command, leaving its start, the wheel install and the copy
of the results room."""

CUDA_BUDGET: dict[str, tuple[float, float]] = {
    # stage: (time box, expected seconds). Expected = the first H200 run's time where the stage ran then as now,
    # else an estimate (docs/gpu-check.md, "Budget"); the expectations must add up to less than the budget.
    "prep": (60, 20),  # measured 17.1 s
    # measured 12.8 s before the benchmark compiled FlexAttention's forward and backward and timed every dense
    # baseline in three phases: that compile is estimated at ~25 s (unmeasured); the box leaves room for it to run long
    "kernel_bench": (180, 40),
    # 106 sm_90 configurations; here 212 compile in 90 s on 2 processes (~0.85 CPU-s each): ~6 s on 16 CPUs, plus
    # start-up and loading each cubin (estimate, never run on the device)
    "kernel_registers": (60, 20),
    "gpu_tests": (120, 90),  # the whole tier: 166.6 s for 38 tests; now 16, but 3 of 9 sliding-window compiles stay
    "train_gca_zero1": (120, 70),  # measured 67.0 s, of it ~42 s the first step's compile
    "train_gca_fsdp2": (120, 70),  # failed after 30.3 s then; expected like ZeRO-1
    "train_swa_zero1": (120, 60),  # timed out then (no step in 111.7 s), before FlexAttention compiled once
    "passkey": (120, 45),  # never reached
    "train_full_zero1": (90, 30),  # never reached; its first step took 1.5 s in a plain loop
}
CPU_BOXES = {"prep": 240, "kernel_bench": 180, "kernel_registers": 60, "gpu_tests": 120, "passkey": 180}
CPU_TRAIN_BOX = 240


def _budget(plan: Plan, name: str) -> tuple[float, float]:
    """(time box, expected seconds) of a stage; the CPU dry run keeps no time for later stages."""
    if plan.cuda:
        return CUDA_BUDGET[name]
    return CPU_BOXES.get(name, CPU_TRAIN_BOX), 0.0


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise StageError(f"{path.name} was not written")
    return path.read_text()


def _read_json(path: Path) -> dict:
    return json.loads(_read_text(path))


def gpu_test_files() -> list[str]:
    """Test files that carry the ``gpu`` marker (collecting only them keeps the tier's imports to its own; the
    word boundary leaves out ``gpucheck``, ``gpucompile`` and ``gpuwheels`` files, whose imports the GPU image
    need not satisfy)."""
    marker = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marker.search(p.read_text()))


GPU_TEST_SELECTION = "bfloat16 or test_model_gpu or (float32 and B64-HQ12-H12-Q65-S64-R8-D64-off1)"
"""The ``-k`` expression of the ``gpu_tests`` stage: one proof of each GPU path instead of the whole tier (38 tests,
166.6 s on the first H200 run). bf16, the training dtype, for every GCA kernel case (fp16 compiles to the same
tiles, docs/results/gpu-compile.md), the decode kernel and every sliding-window case; the model-level tests; and
one fp32 GCA case, because fp32 has tiles of its own and is the dtype evaluation runs in. ``make test-gpu`` still
runs every dtype. tests/gpu_check/test_gpu_check_dry_run.py checks that every GPU test function keeps a case here."""


def _junit_counts(path: Path) -> dict:
    text = _read_text(path)
    head = re.search(r"<testsuite [^>]*>", text)
    if head is None:
        raise StageError(f"{path.name} holds no <testsuite>")
    attrs = dict(re.findall(r'(\w+)="([^"]*)"', head.group(0)))
    counts = {k: int(attrs.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*>\s*<(?:failure|error)', text)
    cases = [dict(re.findall(r'(\w+)="([^"]*)"', tag)) for tag in re.findall(r"<testcase [^>]*>", text)]
    # Where the stage's time goes, for the next budget: the five slowest tests (compile time included).
    timed = sorted(((float(c.get("time", 0)), c.get("name", "?")) for c in cases), reverse=True)
    slowest = [{"test": name, "seconds": round(sec, 1)} for sec, name in timed[:5]]
    return {**counts, "failed_tests": failed[:20], "slowest": slowest}


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

    box, expect = _budget(plan, "prep")
    what = "the built-in corpus (Python stdlib) -> SentencePiece 4096 -> MDS shards"
    return Stage("prep", what, cmd, box, parse, expect_s=expect)


def kernel_stage(plan: Plan) -> Stage:
    out = plan.work / "kernel_bench.json"
    cmd = [plan.python, "-m", "pipeline.bench.kernels", "--out", str(out)] + ([] if plan.cuda else ["--tiny"])
    what = (
        "fused GCA fwd, fwd+bwd and bwd vs naive vs the fastest exact attention on the flattened R*S keys "
        "(SDPA flash/cuDNN/memory-efficient, FlexAttention, flash_attn; B=512 HQ=12 Q=64 S=64 R=8 D=64 bf16)"
        if plan.cuda
        else "the same at tiny fp32 shapes, interpreter"
    )
    env = {} if plan.cuda else {"TRITON_INTERPRET": "1"}  # read when the kernels module is imported
    box, expect = _budget(plan, "kernel_bench")
    return Stage("kernel_bench", what, cmd, box, lambda: _read_json(out), env=env, expect_s=expect)


COMPILE_TABLE = "docs/results/gpu-compile.md"


def registers_stage(plan: Plan) -> Stage:
    """The committed register table checked against the compiled kernels' own metadata on the device."""
    out = plan.work / "kernel_registers.json"
    source = [] if plan.cuda else ["--fake-metadata", "committed"]
    cmd = [plan.python, "-m", "pipeline.gpucheck.registers", "--table", COMPILE_TABLE, "--out", str(out), *source]
    what = (
        f"registers, spills and shared memory of every configuration of {COMPILE_TABLE} for the device's "
        "architecture, read from the kernels this image's triton compiles, beside the committed numbers"
    )
    if not plan.cuda:
        what = f"the comparison with {COMPILE_TABLE} against a stand-in metadata source (no device to compile for)"
    box, expect = _budget(plan, "kernel_registers")
    return Stage("kernel_registers", what, cmd, box, lambda: _read_json(out), expect_s=expect)


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
        "-k",
        GPU_TEST_SELECTION,
        f"--junitxml={junit}",
        *gpu_test_files(),
    ]
    what = (
        "pytest -m gpu, one proof per GPU path: GCA kernels and decode in bf16 (+ one fp32 case), "
        "GPU sliding window in bf16, model-level GPU backends vs references"
    )
    if not plan.cuda:
        what += " (no CUDA: the selection collects and skips itself)"
    box, expect = _budget(plan, "gpu_tests")
    return Stage("gpu_tests", what, cmd, box, lambda: _junit_counts(junit), expect_s=expect)


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
    """Throughput, MFU, peak memory and the loss curve of one run's ``metrics.jsonl``.

    The first step pays for compiling every graph: the trainer logs it apart (``first_step_time_s``) and, on each
    later step, ``steady_step_time_s``, the median step time since the first. Throughput and MFU here are medians
    over the steps after the first, and ``compiles_after_first_step`` counts the compiles a steady state should
    not have (a guard failing every step)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in _read_text(path).splitlines() if ln.strip()]
    rows = [r for r in rows if "loss" in r and "step" in r]
    if not rows:
        raise StageError("metrics.jsonl has no training steps")
    losses = [r["loss"] for r in rows]
    steady = rows[1:] or rows
    third = max(1, len(losses) // 3)
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    first = rows[0].get("first_step_time_s", rows[0]["step_time_s"])
    numbers = {
        "steps": len(rows),
        "tokens_per_step": rows[0].get("tokens"),
        "first_step_time_s": first,
        "step_time_s": rows[-1].get("steady_step_time_s", statistics.median(r["step_time_s"] for r in steady)),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu_sparse_aware": statistics.median(mfu) if mfu else None,
        "steps_total_s": sum(r["step_time_s"] for r in rows),
        "compiles_after_first_step": sum(r.get("compiles", 0) for r in rows[1:]),
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
    box, expect = _budget(plan, name)
    return Stage(name, what, cmd, box, lambda: train_metrics(run_dir), ("prep",), env, expect)


PASSKEY_DEPTHS_WITH_EXPORT = (0.0, 0.5, 1.0)
"""Needle depths (one sample each) with a carried export: accuracy in thirds, three 1M-token prefills."""
NOT_MEANINGFUL = (
    "accuracy not meaningful: the ZeRO-1 stage's export has trained {steps} steps and cannot read a passkey; "
    "tokens/s and peak memory stand. Carry a trained export (the demo's) and pass --export for accuracy"
)


def passkey_stage(plan: Plan) -> Stage:
    out = plan.work / "passkey"
    export = plan.export or str(plan.work / "train" / "train_gca_zero1" / "export")
    length = 1_048_576 if plan.cuda else 65_536
    depths = PASSKEY_DEPTHS_WITH_EXPORT if plan.export else (0.5,)
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
        f"depths=[{','.join(map(str, depths))}]",
        "data=builtin",
        "progress=false",
        f"device={'cuda' if plan.cuda else 'cpu'}",
        f"offload_mb={-1 if plan.cuda else 1024}",
    ]
    steps = plan.steps if plan.cuda else 4
    note = None if plan.export else NOT_MEANINGFUL.format(steps=steps)
    if plan.export:
        what = f"passkey at {length:,} tokens, depths {list(depths)}, with the carried export {plan.export}"
    else:
        what = f"passkey at {length:,} tokens with the ZeRO-1 stage's {steps}-step export (speed and memory only)"

    def parse() -> dict:
        probe = _read_json(out / "probe.json")
        rows = probe["rows"]
        if not rows:
            raise StageError("probe.json has no passkey rows")
        samples = sum(r["n"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        return {
            "length": rows[0].get("length"),
            "samples": samples,
            "depths": [r.get("depth") for r in rows],
            "accuracy": sum(r["accuracy"] * r["n"] for r in rows) / samples,
            "accuracy_meaningful": bool(plan.export),
            "accuracy_note": note,
            "tokens_per_s": round(samples * rows[0]["length"] / max(seconds, 1e-3), 1),
            "seconds": seconds,
            "peak_gpu_mib": probe.get("peak_gpu_mib"),
            "peak_rss_mib": probe.get("peak_rss_mib"),
            "export": export,
        }

    needs = () if plan.export else ("train_gca_zero1",)
    box, expect = _budget(plan, "passkey")
    return Stage("passkey", what, cmd, box, parse, needs, expect_s=expect)


ORDER = (
    "prep",
    "kernel_bench",
    "kernel_registers",
    "gpu_tests",
    "train_gca_zero1",
    "train_gca_fsdp2",
    "train_swa_zero1",
    "passkey",
    "train_full_zero1",
)


def build(plan: Plan) -> list[Stage]:
    """The stages in the order they run: the cheapest proofs first (data, the kernels alone, then the tests and
    the training runs), so a short budget still returns them."""
    makers: dict[str, Callable[[], Stage]] = {
        "prep": lambda: prep_stage(plan),
        "kernel_bench": lambda: kernel_stage(plan),
        "kernel_registers": lambda: registers_stage(plan),
        "gpu_tests": lambda: gpu_tests_stage(plan),
        "passkey": lambda: passkey_stage(plan),
    }
    return [makers[name]() if name in makers else train_stage(plan, name) for name in ORDER]


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
        # Per phase (fwd, fwd_bwd, bwd): the fastest dense baseline's name, and the fused GCA's time over its.
        "kernel_fastest": kernel.get("fastest"),
        "kernel_time_vs_fastest": kernel.get("time_vs_fastest"),
        "kernel_register_table_holds": results.get("kernel_registers", {}).get("numbers", {}).get("table_holds"),
        "stages_ok": sorted(n for n, r in results.items() if r.get("status") == "ok"),
        "stages_not_ok": sorted(n for n, r in results.items() if r.get("status") != "ok"),
    }

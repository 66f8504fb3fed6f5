"""Training step throughput of GCA vs a same-depth sliding-window model vs full attention, DeepSpeed ZeRO-2 on
2 processes vs 1 process, and the cost of summing bf16 gradients in fp32, printed as ratios measured in one run
(``make bench-train``).

Part 0 counts the ATen operators of one training step of each model (``pipeline.bench.step_ops``, the CPU proxy of
the GPU step's kernel launches) and its host synchronisations. Part 1 times one optimizer step (forward, backward,
AdamW) of each model at each sequence length, every configuration in a fresh process, on random tokens. Part 2 runs
the real trainer (``configs/train/debug.yaml`` on a prepared dataset) for a few steps with one process and with
``deepspeed --num_gpus 2`` and compares the median ``tokens_per_s`` of ``metrics.jsonl``. Part 3 runs the trainer
in bf16 under DeepSpeed ZeRO-1 and ZeRO-2 on 2 processes with ``parallel.grad_reduce_dtype`` fp32 (the default) and
bf16 and compares their median ``tokens_per_s`` and rank 0's largest ``mem_gb``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import torch

from kernels.cpu_math import flush_denormals, retain_freed_memory
from pipeline.bench.model import BENCH_CONFIG, bench_model
from pipeline.bench.step_ops import TINY_CONFIG, step_ops
from pipeline.demos.runner import TRAIN_MODULE

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("gca", "swa", "full")
"""The ``model.arch`` of each compared model."""
STEP_MODULE = "pipeline.cli.bench_train"
"""The benchmark's own command line; its hidden ``--one KIND LENGTH`` times one configuration."""
CPU_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
"""Part 2 and 3's environment: one thread per rank, DeepSpeed on its CPU accelerator."""
GRAD_DTYPE_MODEL = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden=1024"]
"""Part 3's model: ``configs/train/debug.yaml``'s 4x wider (4.5M parameters instead of 0.4M), so that its gradients
weigh in the step and the memory."""


def time_step(kind: str, length: int, repeats: int) -> dict:
    """The fastest of ``repeats`` optimizer steps of a fresh ``kind`` model on one random sequence, in seconds."""
    flush_denormals()  # as the trainer does
    retain_freed_memory()
    torch.manual_seed(0)
    model = bench_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, BENCH_CONFIG.vocab_size, (1, length))
    times = []
    for _ in range(repeats + 1):  # the first step warms up allocator and kernels
        start = time.perf_counter()
        model(ids, labels=ids, return_logits=False).loss.backward()  # the trainer's loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"kind": kind, "length": length, "step_s": min(times[1:])}


def _isolated(kind: str, length: int, repeats: int) -> dict:
    """``time_step`` in its own process, so one configuration's memory and threads never slow the next."""
    cmd = [sys.executable, "-m", STEP_MODULE, "--one", kind, str(length), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return {"kind": kind, "length": length, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "tokens_per_s" in r]


def _median_tokens_per_s(run_dir: Path) -> float:
    return statistics.median(r["tokens_per_s"] for r in _metric_rows(run_dir)[3:])  # skip warm-up steps


def _peak_mem_gb(run_dir: Path) -> float:
    """Rank 0's largest ``mem_gb`` over the steps: resident memory at the step's end on CPU, the peak on CUDA."""
    return max(r["mem_gb"] for r in _metric_rows(run_dir))


def _trainer_args(data: str, steps: int, micro_batch: int) -> list[str]:
    """``configs/train/debug.yaml`` on ``data`` for ``steps`` steps of 8 sequences, logging every step, saving
    nothing."""
    return [
        "--config",
        "configs/train/debug.yaml",
        f"data.path={data}",
        f"train.max_steps={steps}",
        "checkpoint.every=0",
        "checkpoint.export=false",
        "train.eval_every=0",
        "logging.every=1",
        "logging.progress=false",
        "train.global_batch=8",
        f"train.micro_batch={micro_batch}",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deepspeed_trainer(args: list[str]) -> None:
    """The trainer on 2 processes under the DeepSpeed launcher, on a free port (another run may hold the default)."""
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port())]
    cmd = [*launcher, "--module", TRAIN_MODULE, *args, "parallel.engine=deepspeed"]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CPU_ENV}, check=True, capture_output=True)


def trainer_throughput(data: str, steps: int) -> tuple[float, float]:
    """Median tokens/s of the real trainer on ``data``: one process, then DeepSpeed ZeRO-2 on 2 processes."""
    common = _trainer_args(data, steps, micro_batch=4)
    with tempfile.TemporaryDirectory() as tmp:
        single, ds = Path(tmp) / "single", Path(tmp) / "zero2"
        subprocess.run(
            [sys.executable, "-m", TRAIN_MODULE, *common, f"run_dir={single}", "parallel.engine=none"],
            cwd=ROOT,
            env={**os.environ, **CPU_ENV, "OMP_NUM_THREADS": "2"},
            check=True,
            capture_output=True,
        )
        _deepspeed_trainer([*common, f"run_dir={ds}", "parallel.zero_stage=2"])
        return _median_tokens_per_s(single), _median_tokens_per_s(ds)


def grad_dtype_costs(data: str, steps: int) -> dict[tuple[int, str], tuple[float, float]]:
    """(ZeRO stage, ``parallel.grad_reduce_dtype``) -> (median tokens/s, rank 0's largest ``mem_gb``) of the
    trainer in bf16 under DeepSpeed on 2 processes, 2 micro-batches per rank and step, with `GRAD_DTYPE_MODEL`."""
    common = [*_trainer_args(data, steps, micro_batch=2), *GRAD_DTYPE_MODEL, "precision.dtype=bf16"]
    costs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (1, 2):
            for dtype in ("fp32", "bf16"):
                run = Path(tmp) / f"zero{stage}_{dtype}"
                settings = [f"run_dir={run}", f"parallel.zero_stage={stage}", f"parallel.grad_reduce_dtype={dtype}"]
                _deepspeed_trainer([*common, *settings])
                costs[stage, dtype] = _median_tokens_per_s(run), _peak_mem_gb(run)
    return costs


def op_count_table(out: TextIO, seq_len: int = 256, compiled: bool = False) -> None:
    """Part 0: per model, the operators of forward + backward and of the optimizer step, views apart, the host
    synchronisations of forward + backward, and the profiler's kernel count of forward + backward, eager and (with
    ``compiled``, minutes of inductor compiling on CPU) with ``train.compile=blocks``."""
    out.write(
        f"ATen operators per training step (CPU proxy of GPU kernel launches): {TINY_CONFIG} model, batch 1, "
        f"{seq_len} tokens, multi-tensor AdamW; 'kernels': torch.profiler's count of fwd+bwd\n\n"
    )
    header = (
        f"{'model':>5} | {'fwd+bwd ops':>11} | {'optim ops':>9} | {'step ops':>8} | {'views':>5} | "
        f"{'kernels':>7} | {'compiled':>8} | host syncs"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    for kind in KINDS:
        r = step_ops(kind, seq_len)
        fused = str(step_ops(kind, seq_len, compiled=True)["forward_backward_kernels"]) if compiled else "-"
        syncs = ", ".join(f"{k} {v}" for k, v in r["host_syncs"].items()) or "none"
        out.write(
            f"{kind:>5} | {r['forward_backward_ops']:>11} | {r['optimizer_ops']:>9} | {r['step_ops']:>8} | "
            f"{r['views']:>5} | {r['forward_backward_kernels']:>7} | {fused:>8} | {syncs}\n"
        )
    out.write("\n")
    out.flush()


def step_time_table(lengths: list[int], repeats: int, out: TextIO) -> None:
    """Part 1: one row per length with each model's step time and GCA's ratio to the other two."""
    out.write(
        f"training step (fwd+bwd+AdamW), batch 1, fp32, {torch.get_num_threads()} threads; model: "
        f"d_model {BENCH_CONFIG.d_model}, {BENCH_CONFIG.n_lower_layers}+{sum(BENCH_CONFIG.groups)}+"
        f"{BENCH_CONFIG.n_encoder_layers} layers, chunk {BENCH_CONFIG.chunk_size}, top-{BENCH_CONFIG.top_k}, "
        f"window {BENCH_CONFIG.window}\n\n"
    )
    header = (
        f"{'T':>6} | {'GCA s/step':>10} | {'SWA s/step':>10} | {'full s/step':>11} | {'GCA/SWA':>8} | {'GCA/full':>8}"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    for length in lengths:
        res = {kind: _isolated(kind, length, repeats) for kind in KINDS}
        cell = {k: (f"{r['step_s']:.2f}" if "step_s" in r else "failed") for k, r in res.items()}
        ok = all("step_s" in r for r in res.values())
        ratio_swa = f"{res['gca']['step_s'] / res['swa']['step_s']:.2f}x" if ok else "-"
        ratio_full = f"{res['gca']['step_s'] / res['full']['step_s']:.2f}x" if ok else "-"
        out.write(
            f"{length:>6} | {cell['gca']:>10} | {cell['swa']:>10} | {cell['full']:>11} | {ratio_swa:>8} | "
            f"{ratio_full:>8}\n"
        )
        out.flush()


def zero2_comparison(data: str, steps: int, out: TextIO) -> None:
    """Parts 2 and 3 (the trainer), skipped with a line saying why when ``data`` (relative to the repository) is not
    a prepared dataset."""
    path = ROOT / data
    if not (path / "_COMPLETE").is_file():
        out.write(f"\nZeRO-2 comparison skipped: {data} is not a complete data-prep output (run `make prep`)\n")
        return
    single, zero2 = trainer_throughput(str(path), steps)
    out.write(
        f"\ntrainer, configs/train/debug.yaml: 1 process {single:,.0f} tokens/s; DeepSpeed ZeRO-2 on 2 "
        f"processes {zero2:,.0f} tokens/s ({zero2 / single:.2f}x)\n"
    )
    grad_dtype_table(grad_dtype_costs(str(path), steps), out)


def grad_dtype_table(costs: dict[tuple[int, str], tuple[float, float]], out: TextIO) -> None:
    """Part 3: per ZeRO stage, the trainer's speed and memory with gradients summed in fp32 and in bf16, and the
    fp32 run's step time and memory over the bf16 run's."""
    out.write(
        f"\ntrainer in bf16, configs/train/debug.yaml x4 wide ({' '.join(GRAD_DTYPE_MODEL)}), DeepSpeed on 2 "
        "processes, 2 micro-batches per rank and step: parallel.grad_reduce_dtype fp32 (default) vs bf16; memory: "
        "rank 0's largest mem_gb\n\n"
    )
    header = (
        f"{'engine':>6} | {'fp32 tok/s':>10} | {'bf16 tok/s':>10} | {'fp32/bf16 time':>14} | {'fp32 GB':>7} | "
        f"{'bf16 GB':>7} | fp32/bf16 memory"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    for stage in sorted({stage for stage, _ in costs}):
        (speed32, mem32), (speed16, mem16) = costs[stage, "fp32"], costs[stage, "bf16"]
        out.write(
            f"{'ZeRO-' + str(stage):>6} | {speed32:>10,.0f} | {speed16:>10,.0f} | {speed16 / speed32:>13.2f}x | "
            f"{mem32:>7.3f} | {mem16:>7.3f} | {mem32 / mem16:.3f}x\n"
        )
    out.flush()

"""Context parallelism against one rank (``make bench-cp``): per-rank peak memory, step time and bytes sent, for
one training sequence on one process (cp=1) and split over ``cp`` processes, measured in one run and printed as
ratios.

Every (length, cp) runs in fresh processes (a gloo group of ``cp`` ranks on 127.0.0.1 when ``cp > 1``) on the same
random sequence and the same initial weights. A step is forward, backward, the SUM all-reduce of the gradients
over the group (``model.context_parallel``'s contract) and AdamW. Memory: the growth of the peak resident set over
the step (``ru_maxrss`` after building the model and optimizer; ``max_memory_allocated`` on CUDA), so it is the
step's activations, gradients and optimizer state, the part CP divides. The first step is the memory step; the
time is the fastest of the ``repeats`` steps after it (slowest rank of each). Bytes: what this rank hands to the
point-to-point and all-to-all calls of ``model.context_parallel`` per step, excluding the gradient all-reduce
(data-parallel traffic that any parallelism pays), with the closed form it should match, and ring attention's
volume for the same sequence and layers as the comparison.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from kernels.cpu_math import flush_denormals, retain_freed_memory
from model.config import GCAConfig
from model.context_parallel import cp_chunk_bounds, cp_loss
from model.gca import GCAForCausalLM
from model.lm import lm_loss
from pipeline.bench.model import BENCH_CONFIG
from pipeline.train.dist import local_rank_from_env

ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = "pipeline.cli.bench_cp"
"""The benchmark's command line; its hidden ``--rank`` mode is one rank of one measurement."""
RANK_TIMEOUT_S = 1800
"""A measurement's processes are killed after this long (a hung exchange must not hang the benchmark)."""
FP32_BYTES = 4


@contextmanager
def count_sent_bytes() -> Iterator[dict[str, int]]:
    """Count the bytes this rank passes to ``dist.isend`` and sends to other ranks through
    ``dist.all_to_all_single`` (the exchanges of ``model.context_parallel``) while the context is open."""
    sent = {"p2p": 0, "all_to_all": 0}
    isend, all_to_all_single = dist.isend, dist.all_to_all_single

    def counting_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent["p2p"] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    def counting_all_to_all(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        splits = kwargs.get("input_split_sizes", args[1] if len(args) > 1 else None)
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input.shape[0] if input.dim() else 0
        row_bytes = input.numel() // max(rows, 1) * input.element_size()
        per_rank = list(splits) if splits else [rows // world] * world
        sent["all_to_all"] += (sum(per_rank) - per_rank[rank]) * row_bytes
        return all_to_all_single(output, input, *args, **kwargs)

    dist.isend, dist.all_to_all_single = counting_isend, counting_all_to_all
    try:
        yield sent
    finally:
        dist.isend, dist.all_to_all_single = isend, all_to_all_single


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(length: int, cp: int, repeats: int) -> dict:
    """One rank's measurement (``cp > 1``: inside the gloo group set up by the environment variables)."""
    flush_denormals()  # as the trainer does
    retain_freed_memory()
    device = torch.device("cuda", local_rank_from_env()) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if cp > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    torch.manual_seed(0)  # the same weights, sequence and Gumbel draws on every rank and in the cp=1 run
    model = GCAForCausalLM(BENCH_CONFIG).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, BENCH_CONFIG.vocab_size, (1, length), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = _peak_bytes(device)
    times, losses = [], []
    for _ in range(repeats + 1):
        if cp > 1:
            dist.barrier()
        start = time.perf_counter()
        with count_sent_bytes() if cp > 1 else _no_count() as sent:
            loss = cp_loss(model, ids, ids) if cp > 1 else lm_loss(model(ids).logits, ids)
            loss.backward()
        loss = loss.detach()
        if cp > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            dist.all_reduce(loss)  # the rank's shares sum to the sequence's loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if len(times) == 1:
            peak = _peak_bytes(device) - before
    slowest = [max(_gather(t, cp)) for t in times]
    peaks = _gather(float(peak), cp)
    result = {
        "length": length,
        "cp": cp,
        "step_s": min(slowest[1:]) if repeats else slowest[0],
        "peak_mb_per_rank": max(peaks) / 2**20,
        "first_loss": losses[0],
        "sent_bytes_per_rank": sum(_gather(float(sum(sent.values())), cp)) / cp,
    }
    if cp > 1:
        dist.destroy_process_group()
    return result


@contextmanager
def _no_count() -> Iterator[dict[str, int]]:
    yield {}


def _gather(value: float, cp: int) -> list[float]:
    if cp == 1:
        return [value]
    out = [0.0] * cp
    dist.all_gather_object(out, value)
    return out


def measure(length: int, cp: int, repeats: int) -> dict:
    """``run_rank`` in ``cp`` fresh processes; rank 0's JSON line, or ``{"error": ...}`` naming what failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // cp)  # the ranks share the machine's cores, as one process uses all
    procs = []
    for rank in range(cp):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(cp),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
        }
        cmd = [sys.executable, "-m", RANK_MODULE, "--rank", str(length), str(cp), "--repeats", str(repeats)]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RANK_TIMEOUT_S))
    except subprocess.TimeoutExpired:
        return {"length": length, "cp": cp, "error": f"timed out after {RANK_TIMEOUT_S} s"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(p.returncode, err) for p, (_, err) in zip(procs, outputs) if p.returncode != 0]
    if failed:
        code, err = failed[0]
        return {"length": length, "cp": cp, "error": f"exit {code}: {(err.strip().splitlines() or ['?'])[-1]}"}
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def cp_bytes_formula(cfg: GCAConfig, length: int, cp: int) -> float:
    """Upper bound of the mean bytes a rank of ``cp`` sends per step (forward and backward, batch 1) for a model
    ``cfg``, summed over what every rank sends and divided by ``cp``: the sliding-window halos (``window`` positions'
    K/V per layer from each rank to the next; their gradients back); the landmark keys (each rank's to every other
    rank; the gradients back); the landmark query before each span (per retrieval group; its gradient back); and,
    per retrieval group, the picked chunks' K/V -- rank ``r`` reads at most ``min(N - N_r, top_k * N_r)`` chunks
    of other ranks -- with their gradients back, plus the chunk ids asked for (8 bytes each) and the counts."""
    kv = 2 * cfg.n_kv_heads * cfg.head_dim * FP32_BYTES  # one position's K and V
    swa_layers = cfg.n_lower_layers + cfg.n_upper_layers
    groups = len(cfg.groups)
    bounds = cp_chunk_bounds(length, cfg.chunk_size, cp)
    n = length // cfg.chunk_size  # chunks with a landmark key
    remote = sum(min(n - (hi - lo), cfg.top_k * (hi - lo)) for lo, hi in zip(bounds, bounds[1:]))
    halo = 2 * (cp - 1) * swa_layers * cfg.window * kv
    keys = 2 * (cp - 1) * n * cfg.d_model * FP32_BYTES
    query = 2 * (cp - 1) * groups * cfg.d_model * FP32_BYTES
    memories = groups * (2 * remote * cfg.chunk_size * kv + remote * 8 + cp * (cp - 1) * 8)
    return (halo + keys + query + memories) / cp


def ring_bytes(cfg: GCAConfig, length: int, cp: int) -> float:
    """What ring attention sends per rank per step for the same sequence if every sliding-window layer were dense:
    in forward each rank passes ``cp - 1`` blocks of ``length / cp`` positions' K/V around the ring; backward passes
    the K/V again and their gradients (about twice the forward)."""
    kv = 2 * cfg.n_kv_heads * cfg.head_dim * FP32_BYTES
    layers = cfg.n_lower_layers + cfg.n_upper_layers
    return float(3 * layers * (cp - 1) * (length / cp) * kv)


def cp_table(lengths: list[int], cp: int, repeats: int, out: TextIO) -> None:
    """One row per length: cp=1 and cp=``cp`` step time, peak memory per rank, bytes sent, and the ratios."""
    cfg = BENCH_CONFIG
    out.write(
        f"one sequence, batch 1, fp32; model: d_model {cfg.d_model}, {cfg.n_lower_layers}+{sum(cfg.groups)}+"
        f"{cfg.n_encoder_layers} layers, chunk {cfg.chunk_size}, top-{cfg.top_k}, window {cfg.window}; "
        f"cp={cp} ranks share {os.cpu_count()} cores\n"
        f"targets: peak memory per rank <= 0.6x cp=1, step time <= 1.3x (cp=1 time / {cp})\n\n"
    )
    columns = [
        ("T", 6),
        ("cp1 s", 7),
        (f"cp{cp} s", 7),
        (f"vs cp1/{cp}", 9),
        ("cp1 MB", 7),
        (f"cp{cp} MB", 7),
        ("mem", 5),
        ("loss diff", 9),
        ("sent MB", 8),
        ("bound MB", 8),
        ("ring MB", 8),
    ]
    header = " | ".join(f"{name:>{width}}" for name, width in columns)
    out.write(header + "\n" + "-" * len(header) + "\n")
    for length in lengths:
        one, split = measure(length, 1, repeats), measure(length, cp, repeats)
        failed = [r for r in (one, split) if "error" in r]
        if failed:
            out.write(f"{length:>6} | cp={failed[0]['cp']} failed: {failed[0]['error']}\n")
            continue
        cells = [
            f"{length:>6}",
            f"{one['step_s']:>7.2f}",
            f"{split['step_s']:>7.2f}",
            f"{split['step_s'] / (one['step_s'] / cp):>8.2f}x",
            f"{one['peak_mb_per_rank']:>7.0f}",
            f"{split['peak_mb_per_rank']:>7.0f}",
            f"{split['peak_mb_per_rank'] / max(one['peak_mb_per_rank'], 1e-9):>4.2f}x",
            f"{abs(split['first_loss'] - one['first_loss']) / abs(one['first_loss']):>9.1e}",
            f"{split['sent_bytes_per_rank'] / 2**20:>8.1f}",
            f"{cp_bytes_formula(BENCH_CONFIG, length, cp) / 2**20:>8.1f}",
            f"{ring_bytes(BENCH_CONFIG, length, cp) / 2**20:>8.1f}",
        ]
        out.write(" | ".join(cells) + "\n")
        out.flush()

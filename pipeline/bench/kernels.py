"""Benchmark of the fused Triton GCA against the naive reference and the fastest exact attention over the same
keys: forward, forward+backward and backward alone.

Front-ends on one measuring core (``measure``):

- ``python -m pipeline.bench.kernels`` (``make bench-kernels``; CUDA only, exits with code 2 on a machine without
  CUDA) prints a table: per implementation and phase ms, TFLOP/s and "x fast", its time over the fastest dense
  attention baseline's (> 1: slower); the skipped baselines on stderr.
- ``python -m pipeline.bench.kernels --out result.json`` (the ``kernel_bench`` stage of ``launch/gpu_check.py``)
  writes the same numbers as JSON with the error against the reference, ``speedup_vs_naive``,
  ``time_vs_fastest`` (and ``time_vs_flash``, against SDPA's flash backend, the stage's older ratio) and the
  targets.
- ``--sweep-tiles`` times every candidate tile (``kernels.gca.triton_utils.tile_candidates``) of every kernel,
  and the fused against the split backward, at the DRT shape and at decode (Q = 1), D = 64 and 128 (or at
  ``--shape``): the measurements from which ``HALF_TILES`` is chosen on a GPU. ``--tiny``: two candidates per
  kernel at a tiny fp16 shape on the interpreter, the plumbing only.
- ``--count-work`` (``TRITON_INTERPRET=1`` only) counts, on the interpreter, what every GCA launch does per
  (batch, kv head): ``tl.dot`` calls and their multiply-adds, bytes loaded and stored. The counts are those of the
  kernels' structure and tiles, so they hold on a GPU too; the times do not.

The dense baselines attend over the same R * S keys under ONE softmax (the same FLOPs, not the same maths), each
named: SDPA with one backend at a time (flash, cuDNN, memory-efficient), FlexAttention (compiled) and, if
installed, ``flash_attn``. A baseline that cannot run here (no such backend for this device, dtype or shape) is
named under ``skipped`` with the reason, never silently replaced. CUDA: the DRT training shape B = batch x query
chunks = 512, HQ = H = 12, Q = 64 query rows per chunk, R = 8 retrieved chunks of S = 64 slots, D = 64, bf16
(``--shape`` for others), timed by ``triton.testing.do_bench`` medians (the L2 cache flushed before every call)
and, for the backward alone, CUDA events around ``autograd.grad`` of a forward made fresh for every call. Each
implementation gets its own freshly drawn inputs (same seed), with ``q, k, v`` and the retrieval weights requiring
grad as in training. ``--tiny`` (the CPU dry run, Triton under ``TRITON_INTERPRET=1``): small fp32 shapes timed
by the wall clock, so the numbers only prove the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep.safe_write import write_text
from kernels.gca import triton_utils as tu
from kernels.gca.naive import naive_gca
from kernels.gca.triton_bwd import bwd_fused_launch, bwd_launches
from kernels.gca.triton_fwd import fwd_launch, gca_fwd
from kernels.gca.triton_gca import triton_gca

log = logging.getLogger(__name__)

SHAPE_NAMES = ("B", "HQ", "H", "Q", "S", "R", "D")
GPU_SHAPE = (512, 12, 12, 64, 64, 8, 64)
TINY_SHAPE = (2, 2, 2, 8, 8, 2, 16)
TINY_SWEEP_SHAPE = (1, 2, 1, 8, 24, 2, 16)  # G * Q = 16 rows: the fused backward runs
# --count-work: the DRT training shape per (batch, kv head) (fused backward), and grouped query heads with the
# landmark row (G * Q = 4 * 65 rows: the split backward), both bf16.
WORK_SHAPES = {"drt": (1, 1, 1, 64, 64, 8, 64), "gqa_q65": (1, 4, 1, 65, 64, 8, 64)}
TARGET_SPEEDUP_VS_NAIVE = 5.0
# Time over the fastest dense baseline's, per phase (issue 49).
TARGET_TIME_VS_FASTEST = {"fwd": 1.0, "fwd_bwd": 1.2, "bwd": 1.2}
PHASES = ("fwd", "fwd_bwd", "bwd")
# Backward: dv = P^T dO, dP = dO v^T, dq = dS k, dk = dS^T q is 2x the forward, plus 0.5x for recomputing P
# (the Triton tutorial's convention). Every implementation is credited the same useful FLOPs.
FLOPS_FACTOR = {"fwd": 1.0, "fwd_bwd": 1 + 2.5, "bwd": 2.5}
GCA_IMPLS = {"triton_gca": "triton (fused GCA)", "naive_gca": "naive_gca (fp32 einsum)"}
SDPA_BACKENDS = {
    "sdpa_flash_flattened": ("FLASH_ATTENTION", "SDPA flash (flattened keys)"),
    "sdpa_cudnn_flattened": ("CUDNN_ATTENTION", "SDPA cuDNN (flattened keys)"),
    "sdpa_efficient_flattened": ("EFFICIENT_ATTENTION", "SDPA mem-efficient (flat keys)"),
}
"""SDPA rows: key -> (the one ``SDPBackend`` it may use, table label)."""
TABLE_NAMES = {
    **GCA_IMPLS,
    **{key: label for key, (_, label) in SDPA_BACKENDS.items()},
    "flex_flattened": "FlexAttention (flattened keys)",
    "flash_attn_flattened": "flash_attn (flattened keys)",
}
"""The table's row label of each implementation key."""
FLASH_REFERENCE = "sdpa_flash_flattened"


def fwd_flops(shape: tuple[int, ...]) -> float:
    """q k^T and P v: 2 * S * D multiply-adds each, per query row, head and retrieved chunk."""
    b, hq, _, q, s, r, d = shape
    return 4.0 * b * hq * q * r * s * d


def _sdpa(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(
                q, k.flatten(2, 3), v.flatten(2, 3), enable_gqa=q.shape[1] != k.shape[1]
            )

    return run


def _flex() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)  # eager flex is an unfused reference

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k.flatten(2, 3), v.flatten(2, 3), enable_gqa=q.shape[1] != k.shape[1])

    return run


def _flash_attn() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from flash_attn import flash_attn_func

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q.transpose(1, 2), k.flatten(2, 3).transpose(1, 2), v.flatten(2, 3).transpose(1, 2))
        return out.transpose(1, 2)

    return run


def dense_baselines(cuda: bool) -> tuple[dict[str, Callable], dict[str, str]]:
    """The dense attention candidates ``(q, k, v) -> o`` for this machine, and the ones skipped before any run with
    the reason (further ones are skipped by ``measure`` when their first call fails)."""
    runs: dict[str, Callable] = {key: _sdpa(backend) for key, (backend, _) in SDPA_BACKENDS.items()}
    skipped: dict[str, str] = {}
    if cuda:
        runs["flex_flattened"] = _flex()
    else:
        skipped["flex_flattened"] = "FlexAttention has no backward on CPU"
    try:
        runs["flash_attn_flattened"] = _flash_attn()
    except ImportError:
        skipped["flash_attn_flattened"] = "flash_attn is not installed"
    return runs, skipped


def _inputs(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh inputs (the same seed every time): ``q, k, v`` and the weights require grad, as in training."""
    b, hq, h, q, s, r, d = shape
    torch.manual_seed(0)
    mk = lambda *dims: torch.randn(*dims, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    return {
        "q": mk(b, hq, q, d),
        "k": mk(b, h, r, s, d),
        "v": mk(b, h, r, s, d),
        "weights": torch.softmax(torch.randn(b, r, device=device), -1).requires_grad_(True),
        "do": torch.randn(b, hq, q, d, device=device, dtype=dtype),
    }


class Timer:
    """Medians in ms: ``do_bench`` on CUDA, the wall clock (after one warm-up call) on CPU."""

    def __init__(self, cuda: bool, reps: int = 3):
        self.cuda = cuda
        self.reps = reps

    def call(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            import triton

            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        fn()  # warm-up (the interpreter traces the kernel once)
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def backward(self, fwd: Callable[[], torch.Tensor], inputs: tuple, do: torch.Tensor) -> float:
        """The backward alone: a fresh forward before every call, outside the timed region."""
        bwd = lambda out: torch.autograd.grad(out, inputs, do)  # noqa: E731
        if not self.cuda:
            bwd(fwd())
            times = []
            for _ in range(self.reps):
                out = fwd()
                start = time.perf_counter()
                bwd(out)
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        for _ in range(5):
            bwd(fwd())
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than any L2, as do_bench does
        times = []
        for _ in range(50):
            out = fwd()
            flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            bwd(out)
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        return statistics.median(times)


def _time_impl(fn: Callable, x: dict[str, torch.Tensor], gca: bool, timer: Timer, flops: float) -> dict[str, float]:
    q, k, v, w, do = x["q"], x["k"], x["v"], x["weights"], x["do"]
    inputs = (q, k, v, w) if gca else (q, k, v)
    fwd = (lambda: fn(q, k, v, w)) if gca else (lambda: fn(q, k, v))
    row = {
        "fwd_ms": timer.call(fwd),
        "fwd_bwd_ms": timer.call(lambda: torch.autograd.grad(fwd(), inputs, do)),
        "bwd_ms": timer.backward(fwd, inputs, do),
    }
    for phase in PHASES:
        row[f"{phase}_tflops"] = flops * FLOPS_FACTOR[phase] / row[f"{phase}_ms"] * 1e-9
    return row


def measure(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> tuple[dict[str, dict], dict[str, str]]:
    """Rows (ms and TFLOP/s per phase) of the fused and naive GCA and every dense baseline that runs here, and
    the skipped baselines with their reasons."""
    cuda = device == "cuda"
    timer = Timer(cuda)
    flops = fwd_flops(shape)
    dense, skipped = dense_baselines(cuda)
    rows: dict[str, dict] = {}
    impls: list[tuple[str, Callable, bool]] = [("triton_gca", triton_gca, True), ("naive_gca", naive_gca, True)]
    impls += [(name, fn, False) for name, fn in dense.items()]
    for name, fn, gca in impls:
        x = _inputs(shape, device, dtype)
        try:
            rows[name] = _time_impl(fn, x, gca, timer, flops)
        except RuntimeError as exc:  # e.g. "No available kernel": this backend cannot take these inputs here
            if gca:
                raise
            skipped[name] = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        del x
        if cuda:
            torch.cuda.empty_cache()
    for row in rows.values():
        for phase in PHASES:
            fastest = min(r[f"{phase}_ms"] for n, r in rows.items() if n not in GCA_IMPLS)
            row[f"{phase}_vs_fastest"] = row[f"{phase}_ms"] / fastest
    return rows, skipped


def result(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> dict:
    """The JSON result at one shape: ``measure``'s rows, the error against the naive reference and the ratios the
    targets judge (``fastest``: the dense baseline with the lowest time, per phase)."""
    rows, skipped = measure(shape, device, dtype)
    x = _inputs(shape, device, dtype)
    q, k, v, w = x["q"], x["k"], x["v"], x["weights"]
    with torch.no_grad():
        err = (triton_gca(q, k, v, w).float() - naive_gca(q.float(), k.float(), v.float(), w)).abs().max().item()
    dense = {n: r for n, r in rows.items() if n not in GCA_IMPLS}
    fastest = {phase: min(dense, key=lambda n: dense[n][f"{phase}_ms"]) for phase in PHASES}
    tri, naive = rows["triton_gca"], rows["naive_gca"]
    out = {
        "shape": dict(zip(SHAPE_NAMES, shape)),
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "fwd_bwd_flops_convention": "backward = 2.5x forward (recomputed P)",
        "impls": rows,
        "skipped": skipped,
        "fastest": fastest,
        "max_abs_err_vs_naive": err,
        "speedup_vs_naive": {p: naive[f"{p}_ms"] / tri[f"{p}_ms"] for p in PHASES},
        "time_vs_fastest": {p: tri[f"{p}_vs_fastest"] for p in PHASES},
    }
    if FLASH_REFERENCE in rows:
        out["flash_reference"] = FLASH_REFERENCE
        out["time_vs_flash"] = {p: tri[f"{p}_ms"] / rows[FLASH_REFERENCE][f"{p}_ms"] for p in PHASES}
    return out


def targets(result: dict, cuda: bool) -> dict:
    """The issue's targets; not judged on the interpreter, whose times mean nothing."""
    if not cuda:
        return {"judged": False, "why": "CPU dry run: Triton runs under the interpreter"}
    judged: dict[str, object] = {"judged": True}
    judged["speedup_vs_naive_ge_5"] = result["speedup_vs_naive"]["fwd_bwd"] >= TARGET_SPEEDUP_VS_NAIVE
    for phase, bound in TARGET_TIME_VS_FASTEST.items():
        judged[f"{phase}_time_vs_fastest_le_{bound}"] = result["time_vs_fastest"][phase] <= bound
    return judged


def print_table(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> None:
    """``make bench-kernels``'s table: ``measure``'s rows, times relative to the fastest dense baseline."""
    rows, skipped = measure(shape, device, dtype)
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    dims = " ".join(f"{name}={n}" for name, n in zip(SHAPE_NAMES, shape))
    print(f"GCA benchmark on {where}: {dims} {dtype}")
    cols = [f"{p} {c}" for p in ("fwd", "f+b", "bwd") for c in ("ms", "TFLOP/s", "x fast")]
    print(f"{'implementation':30s} " + " ".join(f"{c:>11s}" for c in cols))
    for name, row in rows.items():
        cells = [f"{row[f'{p}_ms']:11.3f} {row[f'{p}_tflops']:11.1f} {row[f'{p}_vs_fastest']:11.2f}" for p in PHASES]
        print(f"{TABLE_NAMES[name]:30s} " + " ".join(cells))
    for name, why in skipped.items():  # on stderr: the table stays one row per implementation that ran
        print(f"skipped {TABLE_NAMES[name]}: {why}", file=sys.stderr)


@contextlib.contextmanager
def interpreter_counts() -> Iterator[dict[str, int]]:
    """Count, while open, what the Triton interpreter executes: ``tl.dot`` calls and multiply-adds (whole tiles,
    padding included, as the GPU computes them), bytes loaded and stored (masked-off lanes excluded)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    counts = {"dots": 0, "dot_macs": 0, "bytes_loaded": 0, "bytes_stored": 0}
    dot, load, store = builder.create_dot, builder.create_masked_load, builder.create_masked_store

    def count_dot(a, b, *args):
        counts["dots"] += 1
        counts["dot_macs"] += a.data.shape[-2] * a.data.shape[-1] * b.data.shape[-1]
        return dot(a, b, *args)

    def count_load(ptrs, mask, *args):
        out = load(ptrs, mask, *args)
        counts["bytes_loaded"] += int(mask.data.sum()) * out.data.itemsize
        return out

    def count_store(ptrs, value, mask, *args):
        counts["bytes_stored"] += int(mask.data.sum()) * value.data.itemsize
        return store(ptrs, value, mask, *args)

    builder.create_dot, builder.create_masked_load, builder.create_masked_store = count_dot, count_load, count_store
    try:
        yield counts
    finally:
        del builder.create_dot, builder.create_masked_load, builder.create_masked_store


def count_work(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> dict:
    """Interpreter counts of the training forward and of the backward at ``shape``, per (batch, kv head)."""
    b, hq, h, q, s, r, d = shape
    x = _inputs(shape, "cpu", dtype)
    per = float(b * h)
    with interpreter_counts() as fwd:
        o = triton_gca(x["q"], x["k"], x["v"], x["weights"])
    with interpreter_counts() as bwd:
        torch.autograd.grad(o, (x["q"], x["k"], x["v"], x["weights"]), x["do"])
    return {
        "shape": dict(zip(SHAPE_NAMES, shape)),
        "dtype": str(dtype).removeprefix("torch."),
        "backward_layout": "fused" if tu.fused_backward(hq // h * q, s, d, dtype) else "split",
        "per_batch_kv_head": {
            phase: {key: n / per for key, n in counts.items()} for phase, counts in (("fwd", fwd), ("bwd", bwd))
        },
    }


def _sweep_launch(kernel: str, x: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor], blocks: tu.Blocks):
    """The launch of ``kernel`` on the sweep's inputs and buffers with the tiles ``blocks``."""
    q, k, v, w, do = x["q"], x["k"], x["v"], x["weights"], x["do"]
    scale = q.shape[-1] ** -0.5
    if kernel in ("fwd", "decode"):
        lse = bufs["lse_out"] if kernel == "fwd" else None
        return fwd_launch(q, k, v, w, bufs["o"], lse, scale=scale, softmax_off_by_one=False, blocks=blocks)
    if kernel == "bwd_fused":
        args = (do, q, k, v, w, bufs["lse"], bufs["dq"], bufs["dk"], bufs["dv"], bufs["dw"])
        return bwd_fused_launch(*args, scale=scale, blocks=blocks)
    args = (do, q, k, v, w, bufs["lse"], bufs["delta"], bufs["dq"], bufs["dk"], bufs["dv"])
    dq_launch, dkdv_launch = bwd_launches(*args, scale=scale, blocks=blocks)
    return dq_launch if kernel == "bwd_dq" else dkdv_launch


def sweep_tiles(
    shape: tuple[int, ...], device: str, dtype: torch.dtype, timer: Timer, limit: int | None = None
) -> dict:
    """Time every candidate tile (``tu.tile_candidates``, the first ``limit`` only if given) of every kernel that
    runs at ``shape`` (at Q = 1 only the decode forward), and the fused against the split backward, each at its
    best tiles. A candidate that fails to compile or launch is listed with its error."""
    b, hq, h, q, s, r, d = shape
    GQ = hq // h * q
    x = {key: t.detach() for key, t in _inputs(shape, device, dtype).items()}
    acc = tu.accumulator_dtype(dtype)
    bufs = {
        "o": torch.empty_like(x["q"]),
        "lse_out": torch.empty(b, h, r, GQ, dtype=acc, device=device),
        "delta": torch.zeros(b, h, r, GQ, dtype=acc, device=device),
        "dq": torch.empty_like(x["q"]),
        "dk": torch.empty_like(x["k"]),
        "dv": torch.empty_like(x["v"]),
        "dw": torch.empty(b, h, r, dtype=acc, device=device),
    }
    _, lse = gca_fwd(x["q"], x["k"], x["v"], x["weights"], scale=d**-0.5, softmax_off_by_one=False, save_lse=True)
    assert lse is not None  # save_lse=True
    bufs["lse"] = lse
    kernels = (
        ["decode"] if q == 1 else [kn for kn in tu.KERNELS if kn != "bwd_fused" or tu.fused_backward(GQ, s, d, dtype)]
    )
    out: dict = {"shape": dict(zip(SHAPE_NAMES, shape)), "dtype": str(dtype).removeprefix("torch."), "kernels": {}}
    for kernel in kernels:
        timings = []
        for blocks in tu.tile_candidates(GQ, d, kernel)[:limit]:
            row: dict = {"tiles": f"{blocks.BQ}x{blocks.BS}x{blocks.BD}", "warps": blocks.num_warps}
            row["stages"] = blocks.num_stages
            try:
                row["ms"] = timer.call(_sweep_launch(kernel, x, bufs, blocks).run)
            except Exception as exc:  # a tile that cannot compile or launch here is a result of the sweep
                row["error"] = (
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
                )
            timings.append(row)
        ran = [t for t in timings if "ms" in t]
        out["kernels"][kernel] = {"best": min(ran, key=lambda t: t["ms"]) if ran else None, "timings": timings}
    best = {kn: v["best"]["ms"] for kn, v in out["kernels"].items() if v["best"]}
    if "bwd_dq" in best and "bwd_dkdv" in best:
        layouts = {"split": best["bwd_dq"] + best["bwd_dkdv"]}
        if "bwd_fused" in best:
            layouts["fused"] = best["bwd_fused"]
        out["backward_ms"] = {**layouts, "faster": min(layouts, key=layouts.__getitem__)}
    return out


def parse_shape(text: str) -> tuple[int, ...] | None:
    """``B,HQ,H,Q,S,R,D`` as positive integers with ``HQ`` a multiple of ``H``, else None."""
    try:
        dims = tuple(int(n) for n in text.split(","))
    except ValueError:
        return None
    if len(dims) != len(SHAPE_NAMES) or min(dims) < 1 or dims[1] % dims[2]:
        return None
    return dims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON result (with the targets) here instead of printing the table")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (Triton interpreter)")
    parser.add_argument("--shape", help=f"{','.join(SHAPE_NAMES)} on CUDA (default: the DRT shape)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="CUDA dtype")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--count-work", action="store_true", help="interpreter op counts per launch (TRITON_INTERPRET=1)")
    mode.add_argument(
        "--sweep-tiles", action="store_true", help="time every candidate tile of every kernel (JSON to --out/stdout)"
    )
    args = parser.parse_args(argv)
    shape = parse_shape(args.shape) if args.shape else GPU_SHAPE
    if shape is None:
        print(f"--shape {args.shape}: need {','.join(SHAPE_NAMES)}, positive, HQ a multiple of H", file=sys.stderr)
        return 2
    if args.count_work:
        if not tu.INTERPRET:
            print("--count-work runs the kernels on the Triton interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        print(json.dumps({name: count_work(work_shape) for name, work_shape in WORK_SHAPES.items()}, indent=2))
        return 0
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("pipeline.bench.kernels needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    if args.sweep_tiles:
        if cuda:
            shapes = (
                [shape] if args.shape else [(*shape[:3], rows, *shape[4:6], d) for d in (64, 128) for rows in (64, 1)]
            )
            sweeps = [sweep_tiles(one, device, getattr(torch, args.dtype), Timer(True)) for one in shapes]
        else:  # two candidates per kernel, fp16 (the interpreter's bf16 dot is broken): the plumbing only
            sweeps = [sweep_tiles(TINY_SWEEP_SHAPE, device, torch.float16, Timer(False, reps=1), limit=2)]
        text = json.dumps(sweeps, indent=2) + "\n"
        if args.out:
            write_text(Path(args.out), text)
        else:
            print(text, end="")
        return 0
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    shape = shape if cuda else TINY_SHAPE
    if args.out is None:
        print_table(shape, device, dtype)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out = result(shape, device, dtype)
    out["targets"] = targets(out, cuda)
    write_text(Path(args.out), json.dumps(out, indent=2) + "\n")
    log.info("%s", json.dumps({k: out[k] for k in ("speedup_vs_naive", "time_vs_fastest", "fastest", "targets")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of the fused Triton GCA against the naive reference and dense attention over the flattened keys,
forward and forward+backward.

Two front-ends on one measuring core (``measure``):

- ``python -m pipeline.bench.kernels`` (``make bench-kernels``; CUDA only, exits with code 2 on a machine without
  CUDA) prints a table: ms, TFLOP/s, and columns "x fused", times relative to the fused GCA kernel (> 1: slower
  than it). Its dense rows are SDPA with PyTorch's own choice of backend and, if installed, FlashAttention.
- ``python -m pipeline.bench.kernels --out result.json`` (the ``kernel_bench`` stage of ``launch/gpu_check.py``)
  writes the numbers as JSON with the error against the reference, ``speedup_vs_naive``, ``time_vs_flash`` and the
  targets; its SDPA row is forced onto the flash backend, so it is FlashAttention's time even without
  ``flash_attn``.

CUDA: the DRT training shapes, B = batch x query chunks = 512, HQ = H = 12, Q = 64 query rows per chunk, R = 8
retrieved chunks of S = 64 slots, D = 64, bf16, timed by ``triton.testing.do_bench``. ``--tiny`` (the CPU dry run,
Triton under ``TRITON_INTERPRET=1``): small fp32 shapes timed by the wall clock, so the numbers only prove the
plumbing. The dense baselines attend over the same R * S keys under ONE softmax: the same FLOPs, not the same
maths, so they show what an ordinary fused attention achieves on this work.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.gca.naive import naive_gca
from kernels.gca.triton_gca import triton_gca

log = logging.getLogger(__name__)

SHAPE_NAMES = ("B", "HQ", "H", "Q", "S", "R", "D")
GPU_SHAPE = (512, 12, 12, 64, 64, 8, 64)
TINY_SHAPE = (2, 2, 2, 8, 8, 2, 16)
TARGET_SPEEDUP_VS_NAIVE = 5.0
TARGET_TIME_VS_FLASH = 1.3
# Backward: dv = P^T dO, dP = dO v^T, dq = dS k, dk = dS^T q is 2x the forward, plus 0.5x for recomputing P
# (the Triton tutorial's convention). Every implementation is credited the same useful FLOPs.
FWD_BWD_FLOPS_FACTOR = 1 + 2.5
TABLE_NAMES = {
    "triton_gca": "triton (fused GCA)",
    "naive_gca": "naive_gca (fp32 einsum)",
    "sdpa_flattened": "SDPA (flattened keys)",
    "flash_attn_flattened": "flash_attn (flattened keys)",
}
"""The table's row label of each implementation key it prints."""
SDPA_FLASH = {"sdpa_flattened": False, "sdpa_flash_flattened": True}
"""The SDPA rows: key -> forced onto the flash backend on CUDA (on CPU both are SDPA's own choice: no flash there)."""


def fwd_flops(shape: tuple[int, ...]) -> float:
    """q k^T and P v: 2 * S * D multiply-adds each, per query row, head and retrieved chunk."""
    b, hq, _, q, s, r, d = shape
    return 4.0 * b * hq * q * r * s * d


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool) -> torch.Tensor:
    """One softmax over all R*S keys; ``flash`` (CUDA): only SDPA's flash backend, so this is FlashAttention's time."""
    kf, vf = k.flatten(2, 3), v.flatten(2, 3)
    gqa = q.shape[1] != k.shape[1]
    if not (flash and q.is_cuda):
        return F.scaled_dot_product_attention(q, kf, vf, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, kf, vf, enable_gqa=gqa)


def _flash_attn() -> Callable | None:
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attn_func(q.transpose(1, 2), k.flatten(2, 3).transpose(1, 2), v.flatten(2, 3).transpose(1, 2))

    return run


def _timer(cuda: bool) -> Callable[[Callable], float]:
    if cuda:
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall_ms(fn: Callable) -> float:
        fn()  # warm-up (the interpreter traces the kernel once)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall_ms


def _inputs(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
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


def measure(x: dict[str, torch.Tensor], shape: tuple[int, ...], sdpa: str) -> dict[str, dict[str, float]]:
    """Times (ms) and TFLOP/s, forward and forward+backward, of every implementation on the inputs ``x`` of
    ``shape``: the fused and naive GCA, the SDPA row ``sdpa`` (a key of ``SDPA_FLASH``) and ``flash_attn`` when
    installed (CUDA)."""
    q, k, v, w, do = x["q"], x["k"], x["v"], x["weights"], x["do"]
    impls: dict[str, tuple[Callable, tuple]] = {
        "triton_gca": (lambda: triton_gca(q, k, v, w), (q, k, v, w)),
        "naive_gca": (lambda: naive_gca(q, k, v, w), (q, k, v, w)),
        sdpa: (lambda: _dense(q, k, v, SDPA_FLASH[sdpa]), (q, k, v)),
    }
    cuda = q.is_cuda
    flash = _flash_attn() if cuda else None
    if flash is not None:
        impls["flash_attn_flattened"] = (lambda: flash(q, k, v), (q, k, v))
    time_ms = _timer(cuda)
    flops = fwd_flops(shape)
    rows = {}
    for name, (fwd, inputs) in impls.items():
        fwd_ms = time_ms(fwd)
        fwd_bwd_ms = time_ms(lambda fwd=fwd, inputs=inputs: torch.autograd.grad(fwd(), inputs, do))
        rows[name] = {
            "fwd_ms": fwd_ms,
            "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_tflops": flops / fwd_ms * 1e-9,
            "fwd_bwd_tflops": flops * FWD_BWD_FLOPS_FACTOR / fwd_bwd_ms * 1e-9,
        }
    return rows


def result(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> dict:
    """The JSON result at one shape: ``measure``'s rows with the FlashAttention reference, the error against the
    naive reference and the ratios the targets judge."""
    x = _inputs(shape, device, dtype)
    rows = measure(x, shape, sdpa="sdpa_flash_flattened")
    q, k, v, w = x["q"], x["k"], x["v"], x["weights"]
    with torch.no_grad():
        err = (triton_gca(q, k, v, w).float() - naive_gca(q.float(), k.float(), v.float(), w)).abs().max().item()
    flash_name = "flash_attn_flattened" if "flash_attn_flattened" in rows else "sdpa_flash_flattened"
    tri, naive, dense = rows["triton_gca"], rows["naive_gca"], rows[flash_name]
    return {
        "shape": dict(zip(SHAPE_NAMES, shape)),
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "fwd_bwd_flops_convention": "backward = 2.5x forward (recomputed P)",
        "impls": rows,
        "flash_reference": flash_name,
        "max_abs_err_vs_naive": err,
        "speedup_vs_naive": {key: naive[f"{key}_ms"] / tri[f"{key}_ms"] for key in ("fwd", "fwd_bwd")},
        "time_vs_flash": {key: tri[f"{key}_ms"] / dense[f"{key}_ms"] for key in ("fwd", "fwd_bwd")},
    }


def targets(result: dict, cuda: bool) -> dict:
    """The issue's targets for fwd+bwd; not judged on the interpreter, whose times mean nothing."""
    if not cuda:
        return {"judged": False, "why": "CPU dry run: Triton runs under the interpreter"}
    return {
        "judged": True,
        "speedup_vs_naive_ge_5": result["speedup_vs_naive"]["fwd_bwd"] >= TARGET_SPEEDUP_VS_NAIVE,
        "time_vs_flash_le_1_3": result["time_vs_flash"]["fwd_bwd"] <= TARGET_TIME_VS_FLASH,
    }


def print_table(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> None:
    """``make bench-kernels``'s table: ``measure``'s rows with SDPA's own backend, relative to the fused kernel."""
    rows = measure(_inputs(shape, device, dtype), shape, sdpa="sdpa_flattened")
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    dims = " ".join(f"{name}={n}" for name, n in zip(SHAPE_NAMES, shape))
    print(f"GCA benchmark on {where}: {dims} {dtype}")
    header = ("implementation", "fwd ms", "TFLOP/s", "x fused", "fwd+bwd ms", "TFLOP/s", "x fused")
    print("{:30s} {:>8s} {:>8s} {:>8s} {:>11s} {:>8s} {:>8s}".format(*header))
    ref = rows["triton_gca"]
    for name, row in rows.items():
        print(
            f"{TABLE_NAMES[name]:30s} {row['fwd_ms']:8.3f} {row['fwd_tflops']:8.1f} "
            f"{row['fwd_ms'] / ref['fwd_ms']:8.2f} {row['fwd_bwd_ms']:11.3f} {row['fwd_bwd_tflops']:8.1f} "
            f"{row['fwd_bwd_ms'] / ref['fwd_bwd_ms']:8.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON result (with the targets) here instead of printing the table")
    parser.add_argument("--tiny", action="store_true", help="small fp32 shapes (CPU, Triton interpreter)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("pipeline.bench.kernels needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    shape, dtype = (GPU_SHAPE, torch.bfloat16) if cuda else (TINY_SHAPE, torch.float32)
    if args.out is None:
        print_table(shape, device, dtype)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out = result(shape, device, dtype)
    out["targets"] = targets(out, cuda)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    log.info("%s", json.dumps({k: out[k] for k in ("speedup_vs_naive", "time_vs_flash", "targets")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

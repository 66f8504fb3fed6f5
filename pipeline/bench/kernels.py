"""Benchmark of the fused Triton GCA against the naive reference and dense attention over the flattened keys.

Run: ``python -m pipeline.bench.kernels`` (CUDA only; exits with code 2 on a machine without CUDA).

Shapes follow DRT training: B = batch x query chunks = 512, HQ = H = 12, Q = 64 query rows per chunk, R = 8
retrieved chunks of S = 64 slots, D = 64, bf16. The dense baselines (SDPA and, if installed, FlashAttention)
attend over the same R * S keys under ONE softmax: the same FLOPs, not the same maths, so they show what an
ordinary fused attention achieves on this work. Columns "x fused" are times relative to the fused GCA kernel
(> 1: slower than it).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton

from kernels.gca.naive import naive_gca
from kernels.gca.triton_gca import triton_gca

B, HQ, H, Q, S, R, D = 512, 12, 12, 64, 64, 8, 64
DTYPE = torch.bfloat16

# Forward FLOPs: per query row and retrieved chunk, q k^T and P v are each 2 * S * D multiply-adds.
FWD_FLOPS = 4 * B * HQ * Q * R * S * D
# Backward: dv = P^T dO, dP = dO v^T, dq = dS k, dk = dS^T q is 2x the forward, plus 0.5x for recomputing P
# (the Triton tutorial's convention). Every implementation is credited the same useful FLOPs.
FWD_BWD_FLOPS = FWD_FLOPS * (1 + 2.5)


def _dense_sdpa(q, k, v, weights):
    """One softmax over all R * S keys, the work-equivalent dense attention (weights unused)."""
    kf = k.flatten(2, 3)  # [B, H, R*S, D]
    vf = v.flatten(2, 3)
    return F.scaled_dot_product_attention(q, kf, vf, enable_gqa=HQ != H)


def _dense_flash_attn():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None

    def run(q, k, v, weights):
        kf = k.flatten(2, 3).transpose(1, 2)  # [B, R*S, H, D]
        vf = v.flatten(2, 3).transpose(1, 2)
        return flash_attn_func(q.transpose(1, 2), kf, vf)

    return run


def _time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> int:
    if not torch.cuda.is_available():
        print("pipeline.bench.kernels needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    q = torch.randn(B, HQ, Q, D, device="cuda", dtype=DTYPE, requires_grad=True)
    k = torch.randn(B, H, R, S, D, device="cuda", dtype=DTYPE, requires_grad=True)
    v = torch.randn(B, H, R, S, D, device="cuda", dtype=DTYPE, requires_grad=True)
    weights = torch.softmax(torch.randn(B, R, device="cuda"), dim=-1).requires_grad_(True)
    do = torch.randn(B, HQ, Q, D, device="cuda", dtype=DTYPE)

    impls = {
        "triton (fused GCA)": triton_gca,
        "naive_gca (fp32 einsum)": naive_gca,
        "SDPA (flattened keys)": _dense_sdpa,
    }
    flash = _dense_flash_attn()
    if flash is not None:
        impls["flash_attn (flattened keys)"] = flash

    results = {}
    for name, fn in impls.items():
        inputs = (q, k, v, weights) if fn in (triton_gca, naive_gca) else (q, k, v)
        fwd = _time_ms(lambda fn=fn: fn(q, k, v, weights))
        fwd_bwd = _time_ms(lambda fn=fn, inputs=inputs: torch.autograd.grad(fn(q, k, v, weights), inputs, do))
        results[name] = (fwd, fwd_bwd)

    print(f"GCA benchmark on {torch.cuda.get_device_name()}: B={B} HQ={HQ} H={H} Q={Q} S={S} R={R} D={D} {DTYPE}")
    header = ("implementation", "fwd ms", "TFLOP/s", "x fused", "fwd+bwd ms", "TFLOP/s", "x fused")
    print("{:30s} {:>8s} {:>8s} {:>8s} {:>11s} {:>8s} {:>8s}".format(*header))
    ref_fwd, ref_fwd_bwd = results["triton (fused GCA)"]
    for name, (fwd, fwd_bwd) in results.items():
        print(
            f"{name:30s} {fwd:8.3f} {FWD_FLOPS / fwd * 1e-9:8.1f} {fwd / ref_fwd:8.2f} "
            f"{fwd_bwd:11.3f} {FWD_BWD_FLOPS / fwd_bwd * 1e-9:8.1f} {fwd_bwd / ref_fwd_bwd:8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

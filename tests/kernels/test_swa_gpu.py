"""``gpu_sliding_window_attention`` vs ``naive_sliding_window_attention``.

The CPU test runs the FlexAttention path eagerly in fp64 (exact maths, checks the window/offset/ALiBi wiring);
the GPU tests run whichever fused path the machine has (FlashAttention if installed, else compiled FlexAttention)
in the training dtypes, outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch
from helpers import FP64_REFERENCE, assert_close

from kernels.swa import alibi_slopes
from kernels.swa.gpu import gpu_sliding_window_attention
from kernels.swa.naive import naive_sliding_window_attention

# (B, Tq, Tk, HQ, H, D, window): prefill, a key cache longer than the queries, decode, GQA, window 0, a window
# longer than the sequence, and caches shorter than the window (front-padded to window + Tq keys).
CPU_CASES = [
    (2, 37, 37, 4, 2, 16, 5),
    (1, 3, 50, 4, 4, 32, 8),
    (1, 1, 20, 2, 1, 16, 0),
    (1, 40, 40, 2, 2, 16, 100),
    (2, 2, 5, 4, 2, 16, 8),
    (1, 1, 2, 2, 2, 16, 40),
]
GPU_CASES = [(2, 1040, 1040, 12, 12, 64, 512), (2, 65, 1040, 12, 4, 64, 256), (4, 1, 777, 12, 12, 128, 512)]
# Max error vs the fp64 reference, relative to max |reference|: a few ulps of the dtype (P is rounded to it).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def case_id(case):
    return "B{}-Tq{}-Tk{}-HQ{}-H{}-D{}-W{}".format(*case)


def _inputs(B, Tq, Tk, HQ, H, D, dtype, device):
    q = torch.randn(B, Tq, HQ, D, device=device).to(dtype)
    k = torch.randn(B, Tk, H, D, device=device).to(dtype)
    v = torch.randn(B, Tk, H, D, device=device).to(dtype)
    return q, k, v


@pytest.mark.kernels
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("case", CPU_CASES, ids=case_id)
def test_flex_path_matches_naive_on_cpu(case):
    *shape, window = case
    q, k, v = _inputs(*shape, torch.float64, "cpu")
    slopes = alibi_slopes(shape[3])
    out = gpu_sliding_window_attention(q, k, v, window=window, alibi_slopes=slopes)
    ref = naive_sliding_window_attention(q, k, v, window=window, alibi_slopes=slopes)
    assert_close(out, ref, FP64_REFERENCE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_matches_naive(case, dtype):
    *shape, window = case
    q, k, v = _inputs(*shape, dtype, "cuda")
    do = torch.randn_like(q)
    slopes = alibi_slopes(shape[3]).cuda()

    def run(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        o = fn(*leaves[:3], window=window, alibi_slopes=slopes)
        return (o, *torch.autograd.grad(o, leaves[:3], leaves[3]))

    out = run(gpu_sliding_window_attention, q, k, v, do)
    ref = run(naive_sliding_window_attention, q.double(), k.double(), v.double(), do.double())
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        err = (a.double() - b).abs().max().item()
        bound = TOL[dtype] * max(1.0, b.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"

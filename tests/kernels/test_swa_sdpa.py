"""The fused-SDPA sliding-window path against the O(T * window) reference, values and gradients."""

import pytest
import torch
from helpers import FP64_REFERENCE, assert_close

from kernels.swa import (
    alibi_slopes,
    naive_sliding_window_attention,
    sdpa_sliding_window_attention,
    sliding_window_attention,
)


def _leaves(B, Tq, Tk, HQ, H, D, dtype=torch.float64):
    q = torch.randn(B, Tq, HQ, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Tk, H, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Tk, H, D, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize(
    "B,Tq,Tk,window,HQ,H",
    [
        (2, 300, 300, 16, 4, 4),  # many blocks, short window
        (1, 700, 700, 200, 4, 2),  # several blocks whose span reaches before key 0, GQA
        (2, 5, 40, 16, 2, 2),  # a segment after a cache
        (1, 1, 17, 16, 4, 4),  # one decode token with a full window cache
        (1, 37, 200, 300, 2, 1),  # window longer than everything
        (1, 129, 129, 128, 2, 2),  # one row past a block
    ],
)
def test_matches_reference_values_and_gradients(B, Tq, Tk, window, HQ, H):
    torch.manual_seed(0)
    slopes = alibi_slopes(HQ).double()
    q, k, v = _leaves(B, Tq, Tk, HQ, H, 8)
    do = torch.randn(B, Tq, HQ, 8, dtype=torch.float64)
    ref = naive_sliding_window_attention(q, k, v, window=window, alibi_slopes=slopes)
    got = sdpa_sliding_window_attention(q, k, v, window=window, alibi_slopes=slopes)
    assert_close(got, ref, FP64_REFERENCE)
    for g_ref, g_got in zip(torch.autograd.grad(ref, (q, k, v), do), torch.autograd.grad(got, (q, k, v), do)):
        torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-11)


def test_fp32_close_to_fp64_reference():
    torch.manual_seed(1)
    q, k, v = _leaves(2, 260, 260, 4, 4, 16)
    slopes = alibi_slopes(4)
    ref = naive_sliding_window_attention(q, k, v, window=64, alibi_slopes=slopes.double())
    got = sdpa_sliding_window_attention(q.float(), k.float(), v.float(), window=64, alibi_slopes=slopes)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6)


def test_dispatch_picks_sdpa_on_cpu_and_naive_on_request():
    torch.manual_seed(2)
    q, k, v = (t.detach() for t in _leaves(1, 50, 50, 2, 2, 8))
    slopes = alibi_slopes(2).double()
    args = dict(window=8, alibi_slopes=slopes)
    assert torch.equal(sliding_window_attention(q, k, v, **args), sdpa_sliding_window_attention(q, k, v, **args))
    assert torch.equal(
        sliding_window_attention(q, k, v, backend="naive", **args), naive_sliding_window_attention(q, k, v, **args)
    )
    with pytest.raises(ValueError, match="backend='flash' is not one of"):
        sliding_window_attention(q, k, v, backend="flash", **args)


@pytest.mark.parametrize("fn", [naive_sliding_window_attention, sdpa_sliding_window_attention])
def test_bad_shapes_name_the_rule(fn):
    slopes = alibi_slopes(4)
    with pytest.raises(ValueError, match=r"keys \(Tk=3\) must cover the queries \(Tq=5\)"):
        fn(torch.randn(1, 5, 4, 8), torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), window=4, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="HQ=4 must be a multiple of key/value heads H=3"):
        fn(torch.randn(1, 5, 4, 8), torch.randn(1, 5, 3, 8), torch.randn(1, 5, 3, 8), window=4, alibi_slopes=slopes)

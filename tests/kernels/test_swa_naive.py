"""The O(T * window) sliding-window reference against dense masked attention."""

import pytest
import torch

from kernels.swa import alibi_slopes, naive_sliding_window_attention


def _dense(q, k, v, window, slopes):
    Tq, HQ, D = q.shape[1], q.shape[2], q.shape[3]
    Tk, H = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(HQ // H, 2), v.repeat_interleave(HQ // H, 2)
    dist = (torch.arange(Tq) + Tk - Tq)[:, None] - torch.arange(Tk)[None]  # [Tq, Tk]
    bias = (-slopes[:, None, None] * dist).masked_fill((dist < 0) | (dist > window), float("-inf"))
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5 + bias
    return torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v)


@pytest.mark.parametrize(
    "Tq,Tk,window,HQ,H",
    [(37, 37, 5, 4, 2), (1, 10, 3, 2, 2), (100, 130, 16, 4, 4), (300, 300, 64, 2, 1), (5, 5, 64, 2, 2)],
)
def test_matches_dense_masked_attention(Tq, Tk, window, HQ, H):
    q = torch.randn(2, Tq, HQ, 8, dtype=torch.float64)
    k, v = torch.randn(2, Tk, H, 8, dtype=torch.float64), torch.randn(2, Tk, H, 8, dtype=torch.float64)
    slopes = alibi_slopes(HQ).double()
    got = naive_sliding_window_attention(q, k, v, window=window, alibi_slopes=slopes)
    torch.testing.assert_close(got, _dense(q, k, v, window, slopes))


def test_alibi_slopes_follow_the_paper():
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]))

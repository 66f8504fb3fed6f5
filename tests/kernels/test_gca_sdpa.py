"""The fused-SDPA GCA path against the readable reference: values and all four gradients, fp64."""

import pytest
import torch
from helpers import FP64_REFERENCE, assert_close

from kernels.gca import gca_attention, naive_gca, sdpa_gca


@pytest.mark.parametrize("off_by_one", [False, True])
@pytest.mark.parametrize("B,HQ,H,Q,R,S,D", [(3, 4, 2, 9, 5, 7, 16), (2, 2, 2, 1, 1, 3, 8), (1, 4, 1, 17, 4, 16, 8)])
def test_matches_reference_values_and_gradients(off_by_one, B, HQ, H, Q, R, S, D):
    torch.manual_seed(0)
    q = torch.randn(B, HQ, Q, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H, R, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H, R, S, D, dtype=torch.float64, requires_grad=True)
    w = torch.softmax(torch.randn(B, R, dtype=torch.float64), -1).requires_grad_(True)
    do = torch.randn(B, HQ, Q, D, dtype=torch.float64)
    ref = naive_gca(q, k, v, w, softmax_off_by_one=off_by_one)
    got = sdpa_gca(q, k, v, w, softmax_off_by_one=off_by_one)
    assert_close(got, ref, FP64_REFERENCE)
    grads_ref = torch.autograd.grad(ref, (q, k, v, w), do)
    grads_got = torch.autograd.grad(got, (q, k, v, w), do)
    for name, g_ref, g_got in zip(("dq", "dk", "dv", "dweights"), grads_ref, grads_got):
        torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-11, msg=name)


def test_sdpa_backend_is_selectable():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 3, 4, 8), torch.randn(2, 2, 3, 4, 8)
    w = torch.rand(2, 3)
    assert torch.equal(gca_attention(q, k, v, w, backend="sdpa"), sdpa_gca(q, k, v, w))
    assert torch.equal(gca_attention(q, k, v, w, backend="naive"), naive_gca(q, k, v, w))


def test_rejects_bad_shapes_with_the_argument_named():
    with pytest.raises(ValueError, match=r"weights must be \[B, R\]"):
        sdpa_gca(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 5, 8), torch.randn(1, 2, 4, 5, 8), torch.rand(1, 3))

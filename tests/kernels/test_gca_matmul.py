"""The matmul GCA path (hand-written backward) against the readable reference: values and all four gradients."""

import pytest
import torch

from kernels.gca import gca_attention, matmul_gca, naive_gca


def _inputs(B, HQ, H, Q, R, S, D, dtype=torch.float64):
    q = torch.randn(B, HQ, Q, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, R, S, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, R, S, D, dtype=dtype, requires_grad=True)
    w = torch.softmax(torch.randn(B, R, dtype=dtype), -1).requires_grad_(True)
    return q, k, v, w


def _assert_matches_reference(q, k, v, w, atol, **kw):
    do = torch.randn(q.shape, dtype=q.dtype)
    ref = naive_gca(q, k, v, w, **kw)
    got = matmul_gca(q, k, v, w, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    grads_ref = torch.autograd.grad(ref, (q, k, v, w), do)
    grads_got = torch.autograd.grad(got, (q, k, v, w), do)
    for name, g_ref, g_got in zip(("dq", "dk", "dv", "dweights"), grads_ref, grads_got):
        torch.testing.assert_close(g_got, g_ref, rtol=0, atol=10 * atol, msg=name)


@pytest.mark.parametrize("off_by_one", [False, True])
@pytest.mark.parametrize("B,HQ,H,Q,R,S,D", [(3, 4, 2, 9, 5, 7, 16), (2, 2, 2, 1, 1, 3, 8), (1, 4, 1, 17, 4, 16, 8)])
def test_matches_reference_values_and_gradients(off_by_one, B, HQ, H, Q, R, S, D):
    torch.manual_seed(0)
    _assert_matches_reference(*_inputs(B, HQ, H, Q, R, S, D), atol=1e-12, softmax_off_by_one=off_by_one)


def test_zero_weights_and_large_logits_keep_exact_gradients():
    """A zero weight (an invalid pick) still gets d o / d w = that chunk's output, and logits far above 0 do not
    overflow the off-by-one normaliser."""
    torch.manual_seed(1)
    q, k, v, w = _inputs(2, 2, 2, 5, 3, 4, 8)
    w = torch.tensor([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    _assert_matches_reference(q, k, v, w, atol=1e-12, softmax_off_by_one=True)
    big_q = (q.detach() * 40).requires_grad_(True)
    _assert_matches_reference(big_q, k, v, w, atol=1e-10, softmax_off_by_one=True, scale=1.0)


def test_fp32_and_custom_scale_against_fp64_reference():
    torch.manual_seed(2)
    q, k, v, w = _inputs(2, 4, 2, 6, 3, 5, 16, dtype=torch.float32)
    got = matmul_gca(q, k, v, w, scale=0.3, softmax_off_by_one=True)
    ref = naive_gca(q.double(), k.double(), v.double(), w.double(), scale=0.3, softmax_off_by_one=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)


def test_auto_is_matmul_on_cpu():
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 3, 4, 8), torch.randn(2, 2, 3, 4, 8)
    w = torch.rand(2, 3)
    assert torch.equal(gca_attention(q, k, v, w), matmul_gca(q, k, v, w))
    assert torch.equal(gca_attention(q, k, v, w, backend="matmul"), matmul_gca(q, k, v, w))


def test_rejects_bad_shapes_with_the_argument_named():
    with pytest.raises(ValueError, match=r"weights must be \[B, R\]"):
        matmul_gca(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 5, 8), torch.randn(1, 2, 4, 5, 8), torch.rand(1, 3))


def test_inference_path_equals_the_training_path():
    """Without gradients the probabilities are scaled in place; the output must not change."""
    torch.manual_seed(4)
    q, k, v, w = _inputs(2, 4, 2, 6, 3, 5, 8)
    with torch.no_grad():
        inference = matmul_gca(q, k, v, w, softmax_off_by_one=True)
    assert torch.equal(inference, matmul_gca(q, k, v, w, softmax_off_by_one=True).detach())

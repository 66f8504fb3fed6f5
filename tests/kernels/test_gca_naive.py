"""The GCA reference against independent formulations: a per-token loop, SDPA, explicit zero slot, gradcheck."""

import pytest
import torch
import torch.nn.functional as F

from kernels.gca import gca_attention, naive_gca


def _inputs(B=2, HQ=4, H=2, Q=5, R=3, S=7, D=8, dtype=torch.float64, requires_grad=False):
    q = torch.randn(B, HQ, Q, D, dtype=dtype)
    k = torch.randn(B, H, R, S, D, dtype=dtype)
    v = torch.randn(B, H, R, S, D, dtype=dtype)
    w = torch.softmax(torch.randn(B, R, dtype=dtype), -1)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, w)]


def _loop_reference(q, k, v, w, scale, off_by_one):
    """One token, one head, one chunk at a time: the formula written out with Python loops."""
    B, HQ, Q, D = q.shape
    H, R = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(HQ):
            kv_head = h // (HQ // H)
            for t in range(Q):
                for r in range(R):
                    logits = (k[b, kv_head, r] @ q[b, h, t]) * scale  # [S]
                    e = torch.exp(logits - logits.max())
                    denom = e.sum() + (torch.exp(-logits.max()) if off_by_one else 0.0)
                    out[b, h, t] += w[b, r] * (e / denom) @ v[b, kv_head, r]
    return out


@pytest.mark.parametrize("off_by_one", [False, True])
@pytest.mark.parametrize("HQ,H", [(2, 2), (4, 1)])
def test_matches_per_token_loop(off_by_one, HQ, H):
    q, k, v, w = _inputs(HQ=HQ, H=H)
    expected = _loop_reference(q, k, v, w, 8**-0.5, off_by_one)
    torch.testing.assert_close(naive_gca(q, k, v, w, softmax_off_by_one=off_by_one), expected)


def test_single_chunk_with_unit_weight_is_sdpa():
    q, k, v, _ = _inputs(R=1, HQ=2, H=2)
    w = torch.ones(q.shape[0], 1, dtype=q.dtype)
    expected = F.scaled_dot_product_attention(q, k[:, :, 0], v[:, :, 0])
    torch.testing.assert_close(naive_gca(q, k, v, w), expected)


def test_off_by_one_is_an_extra_zero_key_and_value():
    q, k, v, w = _inputs()
    zero = torch.zeros_like(k[:, :, :, :1])
    expected = naive_gca(q, torch.cat([k, zero], 3), torch.cat([v, zero], 3), w)
    got = naive_gca(q, k, v, w, softmax_off_by_one=True)
    torch.testing.assert_close(got, expected)
    assert (got - naive_gca(q, k, v, w)).abs().max() > 1e-3  # the switch really changes the result


def test_linear_in_weights():
    q, k, v, w = _inputs()
    w2 = torch.rand_like(w)
    torch.testing.assert_close(naive_gca(q, k, v, w + 2 * w2), naive_gca(q, k, v, w) + 2 * naive_gca(q, k, v, w2))


@pytest.mark.parametrize("off_by_one", [False, True])
def test_gradcheck_all_inputs(off_by_one):
    inputs = _inputs(B=1, HQ=2, H=1, Q=3, R=2, S=4, D=4, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: naive_gca(*a, softmax_off_by_one=off_by_one), inputs)


def test_weight_gradient_closed_form():
    """dL/dw_r = sum over heads and rows of <dO, O_r>, the gradient that trains the retriever."""
    q, k, v, w = _inputs()
    w.requires_grad_(True)
    grad_out = torch.randn_like(q)
    (naive_gca(q, k, v, w) * grad_out).sum().backward()
    per_chunk = torch.stack(
        [naive_gca(q, k[:, :, r : r + 1], v[:, :, r : r + 1], torch.ones_like(w[:, :1])) for r in range(w.shape[1])],
        dim=1,
    )  # [B, R, HQ, Q, D]
    expected = (per_chunk * grad_out[:, None]).sum(dim=(2, 3, 4))
    torch.testing.assert_close(w.grad, expected)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda q, k, v, w: (q[0], k, v, w), "q must be"),
        (lambda q, k, v, w: (q, k, v[..., :2], w), "same shape"),
        (lambda q, k, v, w: (q[:, :3], k, v, w), "multiple of key/value heads"),
        (lambda q, k, v, w: (q, k, v, w[:, :1]), "weights must be"),
    ],
)
def test_bad_shapes_raise_naming_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        naive_gca(*bad(*_inputs()))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend="):
        gca_attention(*_inputs(), backend="cuda")

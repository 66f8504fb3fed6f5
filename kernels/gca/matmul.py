"""The GCA operator as two batched matmuls with a hand-written backward (the fast CPU path).

Same contract as ``naive_gca``. For one (batch entry, key/value head), the ``R`` retrieved chunks are contiguous
in ``k [B, H, R, S, D]``, so they form one ``[R*S, D]`` key matrix and one ``[R*S, D]`` value matrix: a single
matmul gives every query's logits against all ``R*S`` slots, the softmax runs per chunk (a ``[.., R, S]`` view),
the retrieval weights scale each chunk's probabilities, and a second matmul gives the mixed output directly.
Grouped-query heads of one key/value head are stacked as extra query rows, so nothing is ever replicated.

Why not autograd on those ops: it would keep ~5 logit-sized intermediates and run as many elementwise passes.
The backward here keeps only the per-chunk probabilities ``A`` and uses

    dP = dO V^T,  t_r = sum_s A_rs dP_rs,  d weights_r = sum_(rows, heads) t_r,
    dLogits = weights_r * A_rs * (dP_rs - t_r),  dQ = dLogits K * scale,  dK = dLogits^T Q * scale,
    dV = (weights_r * A)^T dO.

Softmax-off-by-one (a virtual logit 0 with value 0) only changes the normaliser: ``A = exp(z - log(1 + e^lse(z)))``,
and since that slot's value is zero, the backward formula is the same.
"""

from __future__ import annotations

import torch

from kernels.gca.naive import check_gca_inputs


def _per_chunk_softmax(logits: torch.Tensor, softmax_off_by_one: bool) -> torch.Tensor:
    """Softmax over the last axis of ``logits [..., R, S]`` (in place for off-by-one)."""
    if not softmax_off_by_one:
        return torch.softmax(logits, dim=-1)
    # softmax1(z)_s = exp(z_s) / (1 + sum exp(z)) = exp(z_s - log(e^0 + e^logsumexp(z))); the exponent is <= 0.
    # (F.softplus would not do: it returns its input unchanged above 20, an error of e^-20 on the normaliser.)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    norm = torch.logaddexp(lse, torch.zeros((), dtype=lse.dtype))
    return logits.sub_(norm).exp_()


class _MatmulGCA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weights, scale: float, softmax_off_by_one: bool):  # noqa: ANN001, ANN205
        B, HQ, Q, D = q.shape
        H, R, S = k.shape[1], k.shape[2], k.shape[3]
        rows = HQ // H * Q  # query rows per key/value head
        q_rows = (q * scale).reshape(B, H, rows, D)
        keys, values = k.reshape(B, H, R * S, D), v.reshape(B, H, R * S, D)
        probs = torch.matmul(q_rows, keys.transpose(-1, -2)).view(B, H, rows, R, S)
        probs = _per_chunk_softmax(probs, softmax_off_by_one)  # A
        training = any(ctx.needs_input_grad[:4])
        # weights_r * A; without a backward, A itself is not needed any more and is scaled in place.
        mixed = probs * weights.view(B, 1, 1, R, 1) if training else probs.mul_(weights.view(B, 1, 1, R, 1))
        o = torch.matmul(mixed.view(B, H, rows, R * S), values)  # [B, H, rows, D]
        if training:
            ctx.save_for_backward(q_rows, keys, values, weights, probs)
        ctx.scale, ctx.q_shape = scale, q.shape
        return o.view(B, HQ, Q, D)

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        q_rows, keys, values, weights, probs = ctx.saved_tensors
        B, H, rows, R, S = probs.shape
        D = q_rows.shape[-1]
        do = do.reshape(B, H, rows, D)
        w = weights.view(B, 1, 1, R, 1)
        d_mixed = torch.matmul(do, values.transpose(-1, -2)).view(B, H, rows, R, S)  # dP
        scratch = torch.mul(d_mixed, probs)
        t = scratch.sum(-1, keepdim=True)  # [B, H, rows, R, 1]
        d_weights = t.sum((1, 2)).view(B, R)
        mixed = torch.mul(probs, w, out=scratch).view(B, H, rows, R * S)  # recomputed, not stored
        dv = torch.matmul(mixed.transpose(-1, -2), do)
        d_logits = d_mixed.sub_(t).mul_(mixed.view(B, H, rows, R, S)).view(B, H, rows, R * S)
        dq = torch.matmul(d_logits, keys).mul_(ctx.scale)
        dk = torch.matmul(d_logits.transpose(-1, -2), q_rows)  # q_rows already carries the scale
        shape_kv = (B, H, R, S, D)
        return dq.view(ctx.q_shape), dk.view(shape_kv), dv.view(shape_kv), d_weights, None, None


def matmul_gca(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float | None = None,
    softmax_off_by_one: bool = False,
) -> torch.Tensor:
    """``o [B, HQ, Q, D]`` for ``q [B, HQ, Q, D]``, ``k, v [B, H, R, S, D]``, ``weights [B, R]``; see ``naive_gca``.

    Computes in fp32 (fp64 stays fp64), like the reference, and returns the dtype of ``q``.
    """
    check_gca_inputs(q, k, v, weights)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v, weights = (t.to(compute).contiguous() for t in (k, v, weights))
    return _MatmulGCA.apply(q.to(compute), k, v, weights, scale, softmax_off_by_one).to(q.dtype)

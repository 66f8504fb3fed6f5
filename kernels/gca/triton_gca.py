"""Fused Triton GCA: public entry points and the autograd wrapper.

The kernels live in ``triton_fwd.py`` (forward, also the decode path) and ``triton_bwd.py`` (dq, dk, dv and the
retrieval-weight gradient); shared validation and tile sizes in ``triton_utils.py``. Reference maths:
``kernels/gca/naive.py``. Support matrix: any ``B``, ``Q >= 1``, ``S >= 1``, ``R >= 1``, ``HQ`` a multiple of ``H``,
``16 <= D <= 128``, fp16/bf16/fp32 on CUDA, plus fp64 under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from kernels.gca import triton_utils as tu
from kernels.gca.triton_bwd import gca_bwd
from kernels.gca.triton_fwd import gca_fwd
from kernels.gca.triton_utils import MAX_HEAD_DIM, MIN_HEAD_DIM

__all__ = ["MAX_HEAD_DIM", "MIN_HEAD_DIM", "triton_gca", "triton_gca_decode"]


class TritonGCAFunction(torch.autograd.Function):
    """Saves ``q, k, v, weights`` and the per-(row, chunk) log-sum-exp; the backward recomputes probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, weights, scale, softmax_off_by_one):
        o, lse = gca_fwd(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one, save_lse=True)
        ctx.save_for_backward(q, k, v, weights, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, weights, lse = ctx.saved_tensors
        dq, dk, dv, dweights = gca_bwd(do.contiguous(), q, k, v, weights, lse, scale=ctx.scale)
        return dq, dk, dv, dweights, None, None


def _prepare(q, k, v, weights, scale):
    tu.validate(q, k, v, weights)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return q.contiguous(), k.contiguous(), v.contiguous(), weights.contiguous(), scale


def triton_gca(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float | None = None,
    softmax_off_by_one: bool = False,
) -> torch.Tensor:
    """Fused GCA: ``o[b, h] = sum_r weights[b, r] * softmax_s(q[b, h] . k[b, h // G, r]^T * scale) . v[b, h // G, r]``.

    Same contract as ``kernels.gca.naive.naive_gca``; each retrieved chunk ``r`` has its own softmax.

    Args:
        q: ``[B, HQ, Q, D]``, any ``Q >= 1``.
        k, v: ``[B, H, R, S, D]``, any ``R >= 1`` and ``S >= 1``; ``HQ`` a multiple of ``H`` (``G = HQ // H``).
        weights: ``[B, R]`` retrieval weights, any float dtype; differentiable (``dweights[b, r]`` is the sum over
            heads and rows of ``<dO, O_r>``, the gradient that trains the retriever).
        scale: logit scale, default ``D ** -0.5``.
        softmax_off_by_one: add a virtual logit 0 with value 0 to every per-chunk softmax.

    Returns:
        ``o [B, HQ, Q, D]`` in the dtype of ``q``. When no input requires grad (or grad mode is off) this runs
        the decode path (``triton_gca_decode``), which saves no statistics.

    Raises:
        ValueError: shapes outside the contract, ``D`` outside ``[16, 128]``, mixed q/k/v dtypes, a dtype other
            than fp16/bf16/fp32 (fp64 only under ``TRITON_INTERPRET=1``), or CPU tensors without the interpreter.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, weights))
    if not needs_grad:
        return triton_gca_decode(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one)
    q, k, v, weights, scale = _prepare(q, k, v, weights, scale)
    return TritonGCAFunction.apply(q, k, v, weights, scale, softmax_off_by_one)


def triton_gca_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float | None = None,
    softmax_off_by_one: bool = False,
) -> torch.Tensor:
    """Forward-only GCA for inference (1..Q new tokens, or a whole chunk): same maths and contract as
    ``triton_gca``, no autograd (the output never requires grad) and no saved log-sum-exp."""
    q, k, v, weights, scale = _prepare(q, k, v, weights, scale)
    with torch.no_grad():
        o, _ = gca_fwd(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one, save_lse=False)
    return o

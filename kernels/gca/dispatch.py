"""Backend selection for the GCA operator: explicit, never a silent fallback."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.gca.matmul import matmul_gca
from kernels.gca.naive import naive_gca
from kernels.gca.sdpa import sdpa_gca

GCA_BACKENDS = ("auto", "naive", "matmul", "sdpa", "triton")
"""Every ``backend`` name ``gca_attention`` accepts; the model config validates ``model.gca_backend`` against it."""


def _triton_gca() -> Callable[..., torch.Tensor]:
    try:
        from kernels.gca.triton_gca import triton_gca
    except ImportError as exc:  # triton missing or the kernel module not importable
        raise ImportError(
            f"backend='triton' needs the Triton GCA kernel ({exc}); install triton==3.7.1 "
            "or use backend='naive' (model.gca_backend=naive)"
        ) from exc
    return triton_gca


def gca_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float | None = None,
    softmax_off_by_one: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped Cross Attention over ``R`` retrieved chunks, each with its own softmax.

    ``o = sum_r weights[:, r] * softmax(q . k_r^T * scale) . v_r``.

    Args:
        q: ``[B, HQ, Q, D]``.
        k, v: ``[B, H, R, S, D]`` (``HQ`` a multiple of ``H``).
        weights: ``[B, R]``.
        scale: default ``D ** -0.5``.
        softmax_off_by_one: a virtual zero logit with zero value in every per-chunk softmax.
        backend: ``"auto"`` (triton on CUDA tensors, matmul otherwise), ``"naive"``, ``"matmul"``, ``"sdpa"`` or
            ``"triton"``.

    Returns:
        ``o [B, HQ, Q, D]``, differentiable in q, k, v and weights.

    Raises:
        ValueError: an unknown backend, or (``triton``) inputs outside the kernel's support matrix, including CPU
            tensors without ``TRITON_INTERPRET=1``; the message names the fix. Nothing falls back silently.
    """
    if backend not in GCA_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {GCA_BACKENDS}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "matmul"
    if backend == "naive":
        return naive_gca(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one)
    if backend == "matmul":
        return matmul_gca(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one)
    if backend == "sdpa":
        return sdpa_gca(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one)
    return _triton_gca()(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one)

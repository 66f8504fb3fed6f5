"""Causal sliding-window attention with ALiBi: an O(T * window) PyTorch reference, a fused-SDPA CPU path and a
fast GPU path."""

from __future__ import annotations

import torch

from kernels.swa.naive import naive_sliding_window_attention
from kernels.swa.sdpa import sdpa_sliding_window_attention

SWA_BACKENDS = ("auto", "naive", "sdpa", "gpu")
"""Every ``backend`` name ``sliding_window_attention`` accepts; the model config validates ``model.swa_backend``
against it."""

__all__ = ["SWA_BACKENDS", "alibi_slopes", "sliding_window_attention"]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi slopes ``2^(-8 j / n_heads)`` for ``j = 1..n_heads``."""
    return torch.pow(2.0, -8.0 * torch.arange(1, n_heads + 1, dtype=torch.float32) / n_heads)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    alibi_slopes: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sliding-window ALiBi attention; ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, H, D]``, the queries are the last
    ``Tq`` key positions. ``backend="auto"`` takes the GPU path on CUDA tensors when it is available and the SDPA
    path otherwise; ``"naive"`` is the readable reference."""
    if backend not in SWA_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {SWA_BACKENDS}")
    if backend == "gpu" or (backend == "auto" and q.is_cuda):
        try:
            from kernels.swa.gpu import gpu_sliding_window_attention
        except ImportError as exc:
            if backend == "gpu":
                raise ImportError(f"the GPU sliding-window path is unavailable: {exc}") from exc
        else:
            return gpu_sliding_window_attention(q, k, v, window=window, alibi_slopes=alibi_slopes, scale=scale)
    if backend == "naive":
        return naive_sliding_window_attention(q, k, v, window=window, alibi_slopes=alibi_slopes, scale=scale)
    return sdpa_sliding_window_attention(q, k, v, window=window, alibi_slopes=alibi_slopes, scale=scale)

"""Exact sliding-window ALiBi attention for GPUs: FlashAttention when installed, else PyTorch FlexAttention.

Both paths compute exactly what ``kernels/swa/naive.py`` computes (no approximation, only a different summation
order): query ``i`` sits at key position ``qpos = Tk - Tq + i``, attends to key positions ``p`` with
``0 <= qpos - p <= window``, and adds the logit bias ``-slope_h * (qpos - p)`` to the scaled score. Both are
differentiable.

``flash_attn`` is an optional extra, imported lazily; it covers fp16/bf16 CUDA tensors with ``D % 8 == 0`` and
``D <= 256``. Everything else goes through FlexAttention (compiled on CUDA, eager elsewhere, so the same code is
checkable on CPU).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn_func():
    """``flash_attn.flash_attn_func`` if the optional package is installed, else ``None``."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention materialises the full score matrix; compiled, it is a fused block-sparse kernel.
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=32)
def _window_block_mask(Tq: int, Tk: int, window: int, device: torch.device) -> BlockMask:
    """Block-sparse mask of the causal window; every layer of a step shares it, hence the cache."""
    offset = Tk - Tq

    def in_window(b, h, q_idx, kv_idx):
        dist = q_idx + offset - kv_idx
        return (dist >= 0) & (dist <= window)

    # Compiled mask creation avoids materialising a dense [Tq, Tk] mask on long CUDA sequences.
    return create_block_mask(in_window, None, None, Tq, Tk, device=device, _compile=device.type == "cuda")


def _flex_sliding_window(q, k, v, window, slopes, scale):
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    offset = Tk - Tq

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)

    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    o = attend(
        q.transpose(1, 2),  # [B, HQ, Tq, D]
        k.transpose(1, 2),  # [B, H, Tk, D]
        v.transpose(1, 2),
        score_mod=alibi,
        block_mask=_window_block_mask(Tq, Tk, window, q.device),
        scale=scale,
        enable_gqa=HQ != H,
    )
    return o.transpose(1, 2)  # [B, Tq, HQ, D]


def gpu_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    alibi_slopes: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal sliding-window attention with ALiBi, exact, on fused GPU kernels.

    Args:
        q: ``[B, Tq, HQ, D]``; query ``i`` sits at key position ``Tk - Tq + i``.
        k, v: ``[B, Tk, H, D]`` with ``Tk >= Tq`` and ``HQ`` a multiple of ``H``.
        window: each query sees itself and the ``window`` positions before it (``window >= 0``).
        alibi_slopes: ``[HQ]`` per-head slopes; logit bias ``-slope_h * (qpos - p)``.
        scale: default ``D ** -0.5``.

    Returns:
        ``[B, Tq, HQ, D]`` in the dtype of ``q``.
    """
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    if Tk < Tq:
        raise ValueError(f"keys (Tk={Tk}) must cover the queries (Tq={Tq})")
    if HQ % H != 0:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of key/value heads H={H}")
    if window < 0:
        raise ValueError(f"window={window} must be >= 0")
    if tuple(alibi_slopes.shape) != (HQ,):
        raise ValueError(f"alibi_slopes must be [HQ] = [{HQ}]; got {tuple(alibi_slopes.shape)}")
    if Tq == 0:
        return q.new_zeros(q.shape)
    scale = D**-0.5 if scale is None else scale
    slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)

    flash_attn_func = _flash_attn_func()
    if flash_attn_func is not None and q.is_cuda and q.dtype in _FLASH_DTYPES and D % 8 == 0 and D <= 256:
        # causal=True aligns the mask bottom-right (query i at key Tk - Tq + i); window_size=(window, 0) keeps
        # keys in [qpos - window, qpos]; the ALiBi bias is -slope * |qpos - p|, the same as ours inside the window.
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=(window, 0), alibi_slopes=slopes)
    return _flex_sliding_window(q, k, v, window, slopes, scale)

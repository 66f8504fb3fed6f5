"""Sliding-window causal attention with ALiBi in O(T * window) memory, plain PyTorch (any device).

Query ``i`` sits at key position ``Tk - Tq + i`` (so the keys may start with a cache of earlier positions) and
attends to key positions ``p`` with ``0 <= qpos - p <= window``, with logit bias ``-slope_h * (qpos - p)``.
Queries are processed in blocks of ``block`` rows; each block only sees its ``block + window`` keys, so memory
never grows with ``T**2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Upper bound on the per-call logits tensor; larger problems are cut into groups of query blocks.
_MAX_LOGIT_ELEMENTS = 1 << 25


def check_window_inputs(q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise ``ValueError`` when the keys do not cover the queries or the heads do not group."""
    Tq, HQ = q.shape[1], q.shape[2]
    Tk, H = k.shape[1], k.shape[2]
    if Tk < Tq:
        raise ValueError(f"keys (Tk={Tk}) must cover the queries (Tq={Tq})")
    if HQ % H != 0:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of key/value heads H={H}")


def naive_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    alibi_slopes: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal sliding-window attention with ALiBi.

    Args:
        q: ``[B, Tq, HQ, D]``.
        k, v: ``[B, Tk, H, D]`` with ``Tk >= Tq`` (``HQ`` a multiple of ``H``).
        window: each query sees itself and the ``window`` positions before it.
        alibi_slopes: ``[HQ]`` per-head slopes.
        scale: default ``D ** -0.5``.

    Returns:
        ``[B, Tq, HQ, D]`` in the dtype of ``q``.
    """
    check_window_inputs(q, k)
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    if Tq == 0:
        return q.new_zeros(q.shape)
    G = HQ // H
    scale = D**-0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    block = max(16, min(window, 256))
    n_blocks = -(-Tq // block)
    offset = Tk - Tq  # key position of query 0

    # Left-pad the keys by `window` (masked) and right-pad so every query block has a full key span.
    right = n_blocks * block - Tq
    k_pad = F.pad(k, (0, 0, 0, 0, window, right))  # [B, window + Tk + right, H, D]
    v_pad = F.pad(v, (0, 0, 0, 0, window, right))
    span = block + window
    k_blk = k_pad[:, offset:].unfold(1, span, block)  # [B, NB, H, D, span]
    v_blk = v_pad[:, offset:].unfold(1, span, block)
    q_pad = F.pad(q, (0, 0, 0, 0, 0, right)).view(B, n_blocks, block, H, G, D)  # [B, NB, block, H, G, D]

    # Relative distance of query row r to key column c inside a block span: (r + window) - c.
    dist = torch.arange(block, device=q.device)[:, None] + window - torch.arange(span, device=q.device)[None]
    allowed = (dist >= 0) & (dist <= window)  # [block, span]
    bias = -alibi_slopes.to(compute).view(H, G, 1, 1) * dist.to(compute)  # [H, G, block, span]
    bias = bias.masked_fill(~allowed, float("-inf"))
    # Key columns that fall in the left padding (absolute key position < 0) are masked per block.
    key_pos = torch.arange(n_blocks, device=q.device)[:, None] * block + torch.arange(span, device=q.device)
    key_valid = (key_pos + offset - window) >= 0  # [NB, span]

    out = torch.empty(B, n_blocks, block, H, G, D, dtype=q.dtype, device=q.device)
    per_block = B * block * span * HQ
    step = max(1, _MAX_LOGIT_ELEMENTS // per_block)
    for s in range(0, n_blocks, step):
        e = min(n_blocks, s + step)
        logits = torch.einsum("bnrhgd,bnhdc->bnhgrc", q_pad[:, s:e].to(compute), k_blk[:, s:e].to(compute)) * scale
        logits = logits + bias  # [B, nb, H, G, block, span]
        logits = logits.masked_fill(~key_valid[s:e].view(1, e - s, 1, 1, 1, span), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        o = torch.einsum("bnhgrc,bnhdc->bnrhgd", probs, v_blk[:, s:e].to(compute))
        out[:, s:e] = o.to(q.dtype)
    return out.view(B, n_blocks * block, HQ, D)[:, :Tq]

"""Sliding-window ALiBi attention through PyTorch's fused ``scaled_dot_product_attention`` (the fast CPU path).

Exactly the contract of ``kernels/swa/naive.py`` (only the summation order differs): query ``i`` sits at key
position ``qpos = Tk - Tq + i``, attends to key positions ``p`` with ``0 <= qpos - p <= window`` and adds the logit
bias ``-slope_h * (qpos - p)``. Queries are cut into blocks of ``block`` rows; block ``n`` reads its own span of
``block + window`` keys, so one batched SDPA call over all blocks does O(T * window) work. On CPU, SDPA takes
PyTorch's flash kernel (fused softmax, O(block) memory, fused backward) when every tensor is 4-D and the float
mask is 4-D, which is why the blocks are folded into the batch dimension and the mask gets a leading 1.

The bias mask is shared by every block except the first few, whose spans reach before key 0; those get a mask of
their own (a second, small SDPA call), so the mask never grows with ``T``.

Performance note: with ALiBi, far keys get logits ~100 below the row maximum and the flash backward's ``exp``
lands in fp32 denormals, which are ~2x slower on x86. ``kernels.cpu_math.flush_denormals`` avoids that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.swa.naive import check_window_inputs


def _block_rows(window: int) -> int:
    """Query rows per block: about half the window (a block's span of ``block + window`` keys is then at most
    1.5x the useful work), between 32 (smaller blocks are all overhead) and 128 (enough rows for the flash
    kernel). Measured fwd+bwd on CPU: window 16 and 64 fastest at 32; window 512 within 5% for 64..256."""
    return min(128, max(32, window // 2))


def _alibi_mask(block: int, window: int, slopes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[HQ, block, block + window]``: ALiBi bias inside the window, ``-inf`` outside, for row ``r`` and span
    column ``c`` at distance ``r + window - c``."""
    span = block + window
    dist = torch.arange(block, device=slopes.device)[:, None] + window - torch.arange(span, device=slopes.device)
    allowed = (dist >= 0) & (dist <= window)
    bias = -slopes.to(dtype)[:, None, None] * dist.to(dtype)
    return bias.masked_fill(~allowed, float("-inf"))


def sdpa_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    alibi_slopes: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal sliding-window attention with ALiBi; same arguments and result as
    ``naive_sliding_window_attention`` (``q [B, Tq, HQ, D]``, ``k, v [B, Tk, H, D]``, ``Tk >= Tq``)."""
    check_window_inputs(q, k)
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    if Tq == 0:
        return q.new_zeros(q.shape)
    if HQ != H:  # grouped-query attention: every query head reads its key/value head
        k, v = k.repeat_interleave(HQ // H, dim=2), v.repeat_interleave(HQ // H, dim=2)
    block = min(_block_rows(window), Tq)
    n_blocks = -(-Tq // block)
    offset = Tk - Tq  # key position of query 0
    span = block + window
    right = n_blocks * block - Tq

    def blocks_of(x: torch.Tensor, length: int, step: int) -> torch.Tensor:
        """``[B, n, HQ, length, D]``: block ``n`` holds rows ``[n * step, n * step + length)`` of
        ``x [B, T, HQ, D]``."""
        return x.unfold(1, length, step).permute(0, 1, 2, 4, 3)

    # Left padding by `window` gives the first blocks a full span; right padding completes the last block.
    k_blocks = blocks_of(F.pad(k, (0, 0, 0, 0, window, right))[:, offset:], span, block)
    v_blocks = blocks_of(F.pad(v, (0, 0, 0, 0, window, right))[:, offset:], span, block)
    q_blocks = blocks_of(F.pad(q, (0, 0, 0, 0, 0, right)), block, block)
    mask = _alibi_mask(block, window, alibi_slopes, q.dtype)  # SDPA wants the mask in the query dtype

    # Blocks whose span starts before key 0 (absolute key position of span column c in block n:
    # n * block + c + offset - window) get the shared mask with those columns removed.
    n_head = min(n_blocks, -(-max(0, window - offset) // block))
    parts = []
    for first, last in ((0, n_head), (n_head, n_blocks)):
        if first == last:
            continue
        n = last - first
        if first == 0 and n_head:
            key_pos = torch.arange(n, device=q.device)[:, None] * block + torch.arange(span, device=q.device)
            before_start = (key_pos + offset - window < 0)[:, None, None, :]  # [n, 1, 1, span]
            part_mask = mask[None].masked_fill(before_start, float("-inf")).repeat(B, 1, 1, 1)
        else:
            part_mask = mask[None]
        out = F.scaled_dot_product_attention(
            q_blocks[:, first:last].reshape(B * n, HQ, block, D),
            k_blocks[:, first:last].reshape(B * n, HQ, span, D),
            v_blocks[:, first:last].reshape(B * n, HQ, span, D),
            attn_mask=part_mask,
            scale=scale,
        )
        parts.append(out.view(B, n, HQ, block, D))
    out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return out.transpose(2, 3).reshape(B, n_blocks * block, HQ, D)[:, :Tq]

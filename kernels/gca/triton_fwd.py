"""Triton GCA forward: one program per (batch x kv head, tile of query rows), all ``R`` chunks fused.

For each retrieved chunk ``r`` the program runs a FlashAttention-2 online softmax over the chunk's ``S`` slots
(base 2: logits are pre-multiplied by ``log2(e)``), normalises it, and adds ``w[b, r] * O_r`` to the output
accumulator, so no ``[R, S]`` tensor per query ever reaches memory. With ``SAVE_LSE`` it stores the per-(row,
chunk) log-sum-exp (base 2) that the backward uses to recompute the probabilities.

The chunks' slot tiles are one flat loop of ``R * ceil(S / BS)`` trips (16 at the DRT shape), not a chunk loop
around a slot loop of 2: Triton's pipeliner prefetches across a chunk boundary as within a chunk, and a loop of
two trips gives it nothing to overlap. The last tile of a chunk folds it into the output and restarts the
softmax statistics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gca import triton_utils as tu

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_tile(
    b_q,
    b_m,
    b_l,
    b_or,
    p_kr,
    p_vr,
    o_s,
    o_d,
    m_d,
    qk_scale,
    S,
    D,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    """One online-softmax step over the slot tile ``o_s`` of a chunk: the updated running max, denominator and
    unnormalised output."""
    m_s = o_s < S
    m_sd = m_s[:, None] & m_d[None, :]
    b_k = tl.load(p_kr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
    b_v = tl.load(p_vr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
    # [BQ, BD] x [BD, BS]
    b_s = tu.dot(b_q, tl.trans(b_k), UPCAST, PREC, ACC) * qk_scale
    b_s = tl.where(m_s[None, :], b_s, float("-inf"))
    # Every chunk has S >= 1 slots, so the first tile holds a finite logit and b_m_new is finite.
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - b_m_new[:, None])
    b_alpha = tl.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    # [BQ, BS] x [BS, BD]
    b_or = b_or * b_alpha[:, None] + tu.dot(b_p.to(b_v.dtype), b_v, UPCAST, PREC, ACC)
    return b_m_new, b_l, b_or


@triton.jit
def _gca_fwd_kernel(
    p_q,  # [B*H, GQ, D]
    p_k,  # [B*H, R, S, D]
    p_v,  # [B*H, R, S, D]
    p_w,  # [B, R]
    p_o,  # [B*H, GQ, D]
    p_lse,  # [B*H, R, GQ], base-2 log-sum-exp; unused without SAVE_LSE
    qk_scale,  # scale * log2(e)
    H,
    GQ,
    S,
    D,
    R,
    OFF_BY_ONE: tl.constexpr,
    SAVE_LSE: tl.constexpr,
    BQ: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    # Batch x heads on axis 0: its grid limit is 2**31 - 1, axis 1 is capped at 65535.
    i_bh, i_q = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_b = i_bh // H
    o_m = i_q * BQ + tl.arange(0, BQ)
    o_d = tl.arange(0, BD)
    m_m = o_m < GQ
    m_d = o_d < D

    m_qd = m_m[:, None] & m_d[None, :]
    b_q = tl.load(p_q + (i_bh * GQ + o_m[:, None]) * D + o_d[None, :], mask=m_qd, other=0.0)  # [BQ, BD]
    b_o = tl.zeros([BQ, BD], dtype=ACC)
    if OFF_BY_ONE:
        # The "+1" is a virtual slot with logit 0 and value 0: it seeds the running max with 0 and the
        # denominator with 2**0 = 1, so later rescaling keeps it (a max seeded with -inf would wipe it out).
        m_init = tl.zeros([BQ], dtype=ACC)
        l_init = tl.full([BQ], 1.0, dtype=ACC)
    else:
        m_init = tl.full([BQ], float("-inf"), dtype=ACC)
        l_init = tl.zeros([BQ], dtype=ACC)
    b_m, b_l = m_init, l_init
    b_or = tl.zeros([BQ, BD], dtype=ACC)
    n_s = tl.cdiv(S, BS)
    for i_t in range(R * n_s):
        i_r = i_t // n_s
        i_s = (i_t - i_r * n_s) * BS
        o_chunk = (i_bh * R + i_r) * S * D
        b_m, b_l, b_or = _fwd_tile(
            b_q, b_m, b_l, b_or, p_k + o_chunk, p_v + o_chunk, i_s + tl.arange(0, BS), o_d, m_d, qk_scale, S, D,
            UPCAST, PREC, ACC,
        )  # fmt: skip
        if i_s + BS >= S:  # the chunk's last slot tile: b_m, b_l, b_or are final
            b_w = tl.load(p_w + i_b * R + i_r).to(ACC)
            b_o += b_or * (b_w / b_l)[:, None]
            if SAVE_LSE:
                tl.store(p_lse + (i_bh * R + i_r) * GQ + o_m, b_m + tl.log2(b_l), mask=m_m)
            b_m, b_l = m_init, l_init
            b_or = tl.zeros([BQ, BD], dtype=ACC)
    tl.store(p_o + (i_bh * GQ + o_m[:, None]) * D + o_d[None, :], b_o.to(p_o.dtype.element_ty), mask=m_qd)


def fwd_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    scale: float,
    softmax_off_by_one: bool,
    blocks: tu.Blocks | None = None,
) -> tu.Launch:
    """The forward launch writing ``o`` (and ``lse`` when given); ``blocks`` defaults to ``tu.block_sizes``."""
    H, R, S, D = k.shape[1], k.shape[2], k.shape[3], k.shape[4]
    GQ = q.shape[1] // H * q.shape[2]
    kernel = "fwd" if lse is not None else "decode"
    blocks = blocks or tu.block_sizes(GQ, S, D, q.dtype, kernel, capability=tu.capability(q.device))
    save_lse = lse is not None
    return tu.Launch(
        _gca_fwd_kernel,
        (q.shape[0] * H, triton.cdiv(GQ, blocks.BQ)),
        (
            q,
            k,
            v,
            weights,
            o,
            lse if save_lse else o,  # a placeholder pointer: the kernel never touches it without SAVE_LSE
            scale * LOG2E,
            H,
            GQ,
            S,
            D,
            R,
        ),
        dict(
            OFF_BY_ONE=softmax_off_by_one,
            SAVE_LSE=save_lse,
            **blocks.meta(),
            **tu.kernel_flags(q.dtype),
        ),
    )


def gca_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float,
    softmax_off_by_one: bool,
    save_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward on validated, contiguous inputs.

    Returns ``o [B, HQ, Q, D]`` and, with ``save_lse``, ``lse [B, H, R, G * Q]`` (base 2), else ``None``.
    """
    B, HQ, Q, _ = q.shape
    H, R = k.shape[1], k.shape[2]
    o = tu.alloc(q.shape, q.dtype, q.device)
    lse = tu.alloc((B, H, R, HQ // H * Q), tu.accumulator_dtype(q.dtype), q.device) if save_lse else None
    fwd_launch(q, k, v, weights, o, lse, scale=scale, softmax_off_by_one=softmax_off_by_one).run()
    return o, lse

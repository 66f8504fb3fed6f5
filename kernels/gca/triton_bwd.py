"""Triton GCA backward: ``dq``, ``dk``, ``dv`` and the retrieval-weight gradient ``dweights``.

With ``O = sum_r w_r O_r`` and ``O_r = P_r V_r``, the chunk-``r`` softmax sees the upstream gradient
``dO_r = w_r dO``. One quantity serves two purposes:

    delta_r[m] = <dO[m], O_r[m]>
    dweights[b, r] = sum over heads and rows of delta_r          (d O / d w_r = O_r)
    dS_r = P_r * (dO_r V_r^T - w_r delta_r) = w_r P_r * (dO V_r^T - delta_r)   (FlashAttention's D_i, scaled)

``O_r`` is never stored by the forward (it would cost R times the output), so the first kernel recomputes it from
the saved log-sum-exp, stores ``delta`` and accumulates ``dq``; the second kernel, launched after it, owns a tile
of one chunk's slots, streams all query rows of its key/value head and accumulates ``dk`` and ``dv`` without
atomics. The off-by-one slot needs no term of its own: it is folded into the saved log-sum-exp, its logit is a
constant and its value is zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gca import triton_utils as tu
from kernels.gca.triton_fwd import LOG2E


@triton.jit
def _gca_bwd_dq_kernel(
    p_q,  # [B*H, GQ, D]
    p_k,  # [B*H, R, S, D]
    p_v,  # [B*H, R, S, D]
    p_w,  # [B, R]
    p_do,  # [B*H, GQ, D]
    p_lse,  # [B*H, R, GQ] base 2
    p_delta,  # [B*H, R, GQ] out
    p_dq,  # [B*H, GQ, D] out
    scale,
    qk_scale,  # scale * log2(e)
    H,
    GQ,
    S,
    D,
    R,
    BQ: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    i_bh, i_q = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_b = i_bh // H
    o_m = i_q * BQ + tl.arange(0, BQ)
    o_d = tl.arange(0, BD)
    m_m = o_m < GQ
    m_d = o_d < D

    m_qd = m_m[:, None] & m_d[None, :]
    o_qd = (i_bh * GQ + o_m[:, None]) * D + o_d[None, :]
    b_q = tl.load(p_q + o_qd, mask=m_qd, other=0.0)  # [BQ, BD]
    b_do = tl.load(p_do + o_qd, mask=m_qd, other=0.0)  # [BQ, BD]
    b_dq = tl.zeros([BQ, BD], dtype=ACC)
    for i_r in range(R):
        p_kr = p_k + (i_bh * R + i_r) * S * D
        p_vr = p_v + (i_bh * R + i_r) * S * D
        b_lse = tl.load(p_lse + (i_bh * R + i_r) * GQ + o_m, mask=m_m, other=0.0)  # [BQ]
        b_w = tl.load(p_w + i_b * R + i_r).to(ACC)

        # Pass 1: the unweighted chunk output O_r, only to get delta_r (needed before any dS of this chunk).
        b_or = tl.zeros([BQ, BD], dtype=ACC)
        for i_s in range(0, S, BS):
            o_s = i_s + tl.arange(0, BS)
            m_s = o_s < S
            m_sd = m_s[:, None] & m_d[None, :]
            b_k = tl.load(p_kr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
            b_v = tl.load(p_vr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
            # [BQ, BD] x [BD, BS]
            b_s = tu.dot(b_q, tl.trans(b_k), UPCAST, PREC, ACC) * qk_scale
            b_p = tl.where(m_s[None, :], tl.exp2(b_s - b_lse[:, None]), 0.0)
            # [BQ, BS] x [BS, BD]
            b_or += tu.dot(b_p.to(b_v.dtype), b_v, UPCAST, PREC, ACC)
        b_delta = tl.sum(b_do.to(ACC) * b_or, 1)  # [BQ]
        tl.store(p_delta + (i_bh * R + i_r) * GQ + o_m, b_delta, mask=m_m)

        # Pass 2: dS = w_r P * (dO V^T - delta_r), dq += dS K.
        for i_s in range(0, S, BS):
            o_s = i_s + tl.arange(0, BS)
            m_s = o_s < S
            m_sd = m_s[:, None] & m_d[None, :]
            b_k = tl.load(p_kr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
            b_v = tl.load(p_vr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
            # [BQ, BD] x [BD, BS]
            b_s = tu.dot(b_q, tl.trans(b_k), UPCAST, PREC, ACC) * qk_scale
            b_p = tl.where(m_s[None, :], tl.exp2(b_s - b_lse[:, None]), 0.0)
            # [BQ, BD] x [BD, BS]
            b_dp = tu.dot(b_do, tl.trans(b_v), UPCAST, PREC, ACC)
            b_ds = b_w * b_p * (b_dp - b_delta[:, None])
            # [BQ, BS] x [BS, BD]
            b_dq += tu.dot(b_ds.to(b_k.dtype), b_k, UPCAST, PREC, ACC)
    tl.store(p_dq + o_qd, (b_dq * scale).to(p_dq.dtype.element_ty), mask=m_qd)


@triton.jit
def _gca_bwd_dkdv_kernel(
    p_q,  # [B*H, GQ, D]
    p_k,  # [B*H, R, S, D]
    p_v,  # [B*H, R, S, D]
    p_w,  # [B, R]
    p_do,  # [B*H, GQ, D]
    p_lse,  # [B*H, R, GQ] base 2
    p_delta,  # [B*H, R, GQ]
    p_dk,  # [B*H, R, S, D] out
    p_dv,  # [B*H, R, S, D] out
    scale,
    qk_scale,  # scale * log2(e)
    H,
    GQ,
    S,
    D,
    R,
    BQ: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    # One program owns BS slots of chunk r of one (batch, kv head) and sees all G*Q query rows reading them, so
    # the sum over the G query heads of the group needs no atomics.
    i_bhr, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_bh, i_r = i_bhr // R, i_bhr % R
    i_b = i_bh // H
    o_s = i_s * BS + tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    m_s = o_s < S
    m_d = o_d < D

    m_sd = m_s[:, None] & m_d[None, :]
    o_sd = (i_bhr * S + o_s[:, None]) * D + o_d[None, :]
    b_k = tl.load(p_k + o_sd, mask=m_sd, other=0.0)  # [BS, BD]
    b_v = tl.load(p_v + o_sd, mask=m_sd, other=0.0)  # [BS, BD]
    b_w = tl.load(p_w + i_b * R + i_r).to(ACC)
    b_dk = tl.zeros([BS, BD], dtype=ACC)
    b_dv = tl.zeros([BS, BD], dtype=ACC)
    for i_q in range(0, GQ, BQ):
        o_m = i_q + tl.arange(0, BQ)
        m_m = o_m < GQ
        m_qd = m_m[:, None] & m_d[None, :]
        o_qd = (i_bh * GQ + o_m[:, None]) * D + o_d[None, :]
        b_q = tl.load(p_q + o_qd, mask=m_qd, other=0.0)  # [BQ, BD]
        b_do = tl.load(p_do + o_qd, mask=m_qd, other=0.0)  # [BQ, BD]
        b_lse = tl.load(p_lse + i_bhr * GQ + o_m, mask=m_m, other=0.0)  # [BQ]
        b_delta = tl.load(p_delta + i_bhr * GQ + o_m, mask=m_m, other=0.0)  # [BQ]
        # Transposed scores, so dk and dv come out of the dots without transposing P or dS.
        # [BS, BD] x [BD, BQ]
        b_st = tu.dot(b_k, tl.trans(b_q), UPCAST, PREC, ACC) * qk_scale
        m_sq = m_s[:, None] & m_m[None, :]
        b_pt = tl.where(m_sq, tl.exp2(b_st - b_lse[None, :]), 0.0) * b_w  # [BS, BQ], w_r P^T
        # [BS, BQ] x [BQ, BD]
        b_dv += tu.dot(b_pt.to(b_do.dtype), b_do, UPCAST, PREC, ACC)
        # [BS, BD] x [BD, BQ]
        b_dpt = tu.dot(b_v, tl.trans(b_do), UPCAST, PREC, ACC)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        # [BS, BQ] x [BQ, BD]
        b_dk += tu.dot(b_dst.to(b_q.dtype), b_q, UPCAST, PREC, ACC)
    tl.store(p_dk + o_sd, (b_dk * scale).to(p_dk.dtype.element_ty), mask=m_sd)
    tl.store(p_dv + o_sd, b_dv.to(p_dv.dtype.element_ty), mask=m_sd)


def bwd_launches(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale: float,
    blocks: tu.Blocks | None = None,
) -> tuple[tu.Launch, tu.Launch]:
    """The dq launch (which writes ``delta``) and the dk/dv launch that reads it, in launch order; ``blocks``
    overrides the tiles of both (default: ``tu.block_sizes`` per kernel)."""
    B, H, R, S, D = k.shape
    GQ = q.shape[1] // H * q.shape[2]
    dq_blocks = blocks or tu.block_sizes(GQ, S, D, q.dtype, "bwd_dq")
    dkdv_blocks = blocks or tu.block_sizes(GQ, S, D, q.dtype, "bwd_dkdv")
    args = (scale, scale * LOG2E, H, GQ, S, D, R)
    flags = tu.kernel_flags(q.dtype)
    return (
        tu.Launch(
            _gca_bwd_dq_kernel,
            (B * H, triton.cdiv(GQ, dq_blocks.BQ)),
            (q, k, v, weights, do, lse, delta, dq, *args),
            dict(**dq_blocks.meta(), **flags),
        ),
        tu.Launch(
            _gca_bwd_dkdv_kernel,
            (B * H * R, triton.cdiv(S, dkdv_blocks.BS)),
            (q, k, v, weights, do, lse, delta, dk, dv, *args),
            dict(**dkdv_blocks.meta(), **flags),
        ),
    )


def gca_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch both backward kernels on contiguous tensors; returns ``dq, dk, dv, dweights``.

    ``lse [B, H, R, G * Q]`` is the base-2 log-sum-exp saved by the forward.
    """
    delta = tu.alloc(lse.shape, lse.dtype, q.device)  # [B, H, R, GQ]
    dq = tu.alloc(q.shape, q.dtype, q.device)
    dk = tu.alloc(k.shape, k.dtype, k.device)
    dv = tu.alloc(v.shape, v.dtype, v.device)
    for launch in bwd_launches(do, q, k, v, weights, lse, delta, dq, dk, dv, scale=scale):
        launch.run()  # dq first: the dk/dv kernel reads the delta it writes
    dweights = delta.sum(dim=(1, 3)).to(weights.dtype)  # [B, R]: sum over kv heads and their G*Q rows
    return dq, dk, dv, dweights

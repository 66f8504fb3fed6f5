"""Triton GCA backward: ``dq``, ``dk``, ``dv`` and the retrieval-weight gradient ``dweights``.

With ``O = sum_r w_r O_r`` and ``O_r = P_r V_r``, the chunk-``r`` softmax sees the upstream gradient
``dO_r = w_r dO``. One quantity serves two purposes:

    delta_r[m] = <dO[m], O_r[m]> = sum_s P_r[m, s] dP_r[m, s],   dP_r = dO V_r^T
    dweights[b, r] = sum over heads and rows of delta_r          (d O / d w_r = O_r)
    dS_r = P_r * (dO_r V_r^T - w_r delta_r) = w_r P_r * (dO V_r^T - delta_r)   (FlashAttention's D_i, scaled)

``O_r`` is never stored (it would cost R times the output), and neither is ``delta_r`` (it needs ``dO``). When a
chunk's ``S`` slots fit in one slot tile (``S <= BS``; DRT's ``S = 63/64`` in the fused kernel's 64-slot tiles,
see ``triton_utils.HALF_TILES``; sm_80 takes 32-slot tiles there, ``SM80_TILES``) the whole row of ``P_r`` and
``dP_r`` is in registers, so ``delta_r`` is their row sum, from the two products the ``dS`` pass computes
anyway: 3 dots per (query tile, chunk) for ``dq``. Longer chunks take a first pass over their slot tiles that
recomputes ``O_r`` (2 dots per tile), then the ``dS`` pass.

Two layouts:

- fused (``_gca_bwd_fused_kernel``), when one query tile holds all ``G * Q`` rows of a key/value head (DRT
  training: ``G = 1``, ``Q = 64``): one program per (batch, kv head) sees every row reading each chunk, so it
  reads each chunk's keys and values once and writes ``dq``, ``dk``, ``dv`` and the per-chunk sums of
  ``delta`` without atomics: the 5 dots of FlashAttention-2's backward per (query tile, slot tile).
- split, otherwise: the dq kernel also stores ``delta``; the dk/dv kernel, launched after it, owns a tile of one
  chunk's slots, streams all query rows of its key/value head and reads ``delta``.

The off-by-one slot needs no term of its own: it is folded into the saved log-sum-exp, its logit is a constant
and its value is zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gca import triton_utils as tu
from kernels.gca.triton_fwd import LOG2E


@triton.jit
def _probs(b_q, b_k, b_lse, m_qs, qk_scale, UPCAST: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """``P = 2^(q k^T * qk_scale - lse)`` of one (query tile, slot tile), 0 outside ``m_qs``: ``[BQ, BS]``."""
    b_s = tu.dot(b_q, tl.trans(b_k), UPCAST, PREC, ACC) * qk_scale
    return tl.where(m_qs, tl.exp2(b_s - b_lse[:, None]), 0.0)


@triton.jit
def _chunk_delta(
    b_q,
    b_do,
    p_kr,
    p_vr,
    b_lse,
    m_m,
    o_d,
    m_d,
    qk_scale,
    S,
    D,
    BS: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    """``delta_r = <dO, O_r>`` with ``O_r`` recomputed over all slot tiles of chunk ``r`` (the first pass of a
    long chunk; a [BQ, BD] accumulator holds fewer registers here than row sums of ``P * dP`` built tile by tile)."""
    b_or = tl.zeros_like(b_do).to(ACC)
    for i_s in range(0, S, BS):
        o_s = i_s + tl.arange(0, BS)
        m_s = o_s < S
        m_sd = m_s[:, None] & m_d[None, :]
        b_k = tl.load(p_kr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
        b_v = tl.load(p_vr + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.0)  # [BS, BD]
        b_p = _probs(b_q, b_k, b_lse, m_m[:, None] & m_s[None, :], qk_scale, UPCAST, PREC, ACC)
        # [BQ, BS] x [BS, BD]
        b_or += tu.dot(b_p.to(b_v.dtype), b_v, UPCAST, PREC, ACC)
    return tl.sum(b_do.to(ACC) * b_or, 1)


@triton.jit
def _dq_tile(
    b_q,
    b_do,
    b_dq,
    b_lse,
    b_delta,
    b_w,
    p_kr,
    p_vr,
    p_dkr,
    p_dvr,
    o_s,
    m_m,
    o_d,
    m_d,
    scale,
    qk_scale,
    S,
    D,
    ONE_TILE: tl.constexpr,
    DKDV: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    """One (query tile, slot tile ``o_s``) of chunk ``r``: returns ``dq + dS K`` and ``delta_r`` (computed here when
    the chunk is this one tile, else passed in). With ``DKDV`` the query tile holds every row reading these slots,
    so it also stores their complete ``dk`` and ``dv`` at ``p_dkr``/``p_dvr``."""
    m_s = o_s < S
    m_sd = m_s[:, None] & m_d[None, :]
    o_sd = o_s[:, None] * D + o_d[None, :]
    b_k = tl.load(p_kr + o_sd, mask=m_sd, other=0.0)  # [BS, BD]
    b_v = tl.load(p_vr + o_sd, mask=m_sd, other=0.0)  # [BS, BD]
    b_p = _probs(b_q, b_k, b_lse, m_m[:, None] & m_s[None, :], qk_scale, UPCAST, PREC, ACC)
    b_dp = tu.dot(b_do, tl.trans(b_v), UPCAST, PREC, ACC)  # [BQ, BS]
    if ONE_TILE:  # the whole chunk is this tile: delta_r from the same P and dP
        b_delta = tl.sum(b_p * b_dp, 1)
    b_pw = b_w * b_p  # w_r P
    b_ds = b_pw * (b_dp - b_delta[:, None])
    if DKDV:
        # [BS, BQ] x [BQ, BD]
        b_dv = tu.dot(tl.trans(b_pw).to(b_do.dtype), b_do, UPCAST, PREC, ACC)
        b_dk = tu.dot(tl.trans(b_ds).to(b_q.dtype), b_q, UPCAST, PREC, ACC)
        tl.store(p_dvr + o_sd, b_dv.to(p_dvr.dtype.element_ty), mask=m_sd)
        tl.store(p_dkr + o_sd, (b_dk * scale).to(p_dkr.dtype.element_ty), mask=m_sd)
    # [BQ, BS] x [BS, BD]
    return b_dq + tu.dot(b_ds.to(b_k.dtype), b_k, UPCAST, PREC, ACC), b_delta


@triton.jit
def _dq_rows(
    p_q,
    p_k,
    p_v,
    p_w,
    p_do,
    p_lse,
    p_dq,
    p_dk,
    p_dv,
    i_bh,
    o_m,
    p_delta_out,  # [B*H, R, GQ] delta per row (not DKDV), or [B*H, R] its sum over the rows (DKDV)
    scale,
    qk_scale,
    H,
    GQ,
    S,
    D,
    R,
    BQ: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    ONE_TILE: tl.constexpr,
    DKDV: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    """``dq`` of the query rows ``o_m`` of kv head ``i_bh`` over all chunks (and, with ``DKDV``, the chunks'
    ``dk``, ``dv``). A one-tile chunk has no slot loop, so the chunk loop is innermost and Triton's pipeliner
    prefetches the next chunk's K and V (``num_stages``) while this one is computed."""
    i_b = i_bh // H
    o_d = tl.arange(0, BD)
    m_m = o_m < GQ
    m_d = o_d < D
    m_qd = m_m[:, None] & m_d[None, :]
    o_qd = (i_bh * GQ + o_m[:, None]) * D + o_d[None, :]
    b_q = tl.load(p_q + o_qd, mask=m_qd, other=0.0)  # [BQ, BD]
    b_do = tl.load(p_do + o_qd, mask=m_qd, other=0.0)  # [BQ, BD]
    b_dq = tl.zeros([BQ, BD], dtype=ACC)
    for i_r in range(R):
        o_chunk = (i_bh * R + i_r) * S * D
        p_kr, p_vr, p_dkr, p_dvr = p_k + o_chunk, p_v + o_chunk, p_dk + o_chunk, p_dv + o_chunk
        b_lse = tl.load(p_lse + (i_bh * R + i_r) * GQ + o_m, mask=m_m, other=0.0)  # [BQ]
        b_w = tl.load(p_w + i_b * R + i_r).to(ACC)
        b_delta = tl.zeros_like(b_lse)
        if ONE_TILE:
            b_dq, b_delta = _dq_tile(
                b_q, b_do, b_dq, b_lse, b_delta, b_w, p_kr, p_vr, p_dkr, p_dvr, tl.arange(0, BS), m_m, o_d, m_d,
                scale, qk_scale, S, D, ONE_TILE, DKDV, UPCAST, PREC, ACC,
            )  # fmt: skip
        else:  # a long chunk: delta_r needs every slot tile before the first dS
            b_delta = _chunk_delta(b_q, b_do, p_kr, p_vr, b_lse, m_m, o_d, m_d, qk_scale, S, D, BS, UPCAST, PREC, ACC)
            for i_s in range(0, S, BS):
                b_dq, b_delta = _dq_tile(
                    b_q, b_do, b_dq, b_lse, b_delta, b_w, p_kr, p_vr, p_dkr, p_dvr, i_s + tl.arange(0, BS), m_m, o_d,
                    m_d, scale, qk_scale, S, D, ONE_TILE, DKDV, UPCAST, PREC, ACC,
                )  # fmt: skip
        if DKDV:
            tl.store(p_delta_out + i_bh * R + i_r, tl.sum(b_delta, 0))
        else:
            tl.store(p_delta_out + (i_bh * R + i_r) * GQ + o_m, b_delta, mask=m_m)
    tl.store(p_dq + o_qd, (b_dq * scale).to(p_dq.dtype.element_ty), mask=m_qd)


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
    ONE_TILE: tl.constexpr,  # S <= BS
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    i_bh, i_q = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_m = i_q * BQ + tl.arange(0, BQ)
    # p_k, p_v stand in for the unused dk, dv pointers: nothing is stored there without DKDV.
    _dq_rows(
        p_q, p_k, p_v, p_w, p_do, p_lse, p_dq, p_k, p_v, i_bh, o_m, p_delta, scale, qk_scale, H, GQ, S, D, R,
        BQ, BS, BD, ONE_TILE, False, UPCAST, PREC, ACC,
    )  # fmt: skip


@triton.jit
def _gca_bwd_fused_kernel(
    p_q,  # [B*H, GQ, D]
    p_k,  # [B*H, R, S, D]
    p_v,  # [B*H, R, S, D]
    p_w,  # [B, R]
    p_do,  # [B*H, GQ, D]
    p_lse,  # [B*H, R, GQ] base 2
    p_dq,  # [B*H, GQ, D] out
    p_dk,  # [B*H, R, S, D] out
    p_dv,  # [B*H, R, S, D] out
    p_dw,  # [B*H, R] out: sum of delta_r over the GQ rows
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
    ONE_TILE: tl.constexpr,  # S <= BS
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    # One program per (batch, kv head) with all GQ <= BQ rows: it alone reads and writes its chunks' gradients.
    i_bh = tl.program_id(0).to(tl.int64)
    _dq_rows(
        p_q, p_k, p_v, p_w, p_do, p_lse, p_dq, p_dk, p_dv, i_bh, tl.arange(0, BQ), p_dw, scale, qk_scale, H, GQ, S,
        D, R, BQ, BS, BD, ONE_TILE, True, UPCAST, PREC, ACC,
    )  # fmt: skip


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
    """The split layout: the dq launch (which writes ``delta``) and the dk/dv launch that reads it, in launch
    order; ``blocks`` overrides the tiles of both (default: ``tu.block_sizes`` per kernel)."""
    B, H, R, S, D = k.shape
    GQ = q.shape[1] // H * q.shape[2]
    arch = tu.capability(q.device)
    dq_blocks = blocks or tu.block_sizes(GQ, S, D, q.dtype, "bwd_dq", capability=arch)
    dkdv_blocks = blocks or tu.block_sizes(GQ, S, D, q.dtype, "bwd_dkdv", capability=arch)
    args = (scale, scale * LOG2E, H, GQ, S, D, R)
    flags = tu.kernel_flags(q.dtype)
    return (
        tu.Launch(
            _gca_bwd_dq_kernel,
            (B * H, triton.cdiv(GQ, dq_blocks.BQ)),
            (q, k, v, weights, do, lse, delta, dq, *args),
            dict(**dq_blocks.meta(), ONE_TILE=S <= dq_blocks.BS, **flags),
        ),
        tu.Launch(
            _gca_bwd_dkdv_kernel,
            (B * H * R, triton.cdiv(S, dkdv_blocks.BS)),
            (q, k, v, weights, do, lse, delta, dk, dv, *args),
            dict(**dkdv_blocks.meta(), **flags),
        ),
    )


def bwd_fused_launch(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dw: torch.Tensor,
    *,
    scale: float,
    blocks: tu.Blocks | None = None,
) -> tu.Launch:
    """The fused layout's one launch (``blocks.BQ`` must hold all ``G * Q`` rows); ``dw [B, H, R]`` receives the
    per-(kv head, chunk) sums of ``delta``."""
    B, H, R, S, D = k.shape
    GQ = q.shape[1] // H * q.shape[2]
    blocks = blocks or tu.block_sizes(GQ, S, D, q.dtype, "bwd_fused", capability=tu.capability(q.device))
    if blocks.BQ < GQ:
        raise ValueError(f"the fused backward needs one query tile for all G*Q={GQ} rows; BQ={blocks.BQ}")
    return tu.Launch(
        _gca_bwd_fused_kernel,
        (B * H,),
        (q, k, v, weights, do, lse, dq, dk, dv, dw, scale, scale * LOG2E, H, GQ, S, D, R),
        dict(**blocks.meta(), ONE_TILE=S <= blocks.BS, **tu.kernel_flags(q.dtype)),
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
    """The backward on contiguous tensors, fused when ``tu.fused_backward`` allows it; returns ``dq, dk, dv,
    dweights``.

    ``lse [B, H, R, G * Q]`` is the base-2 log-sum-exp saved by the forward.
    """
    B, H, R, S, D = k.shape
    dq = tu.alloc(q.shape, q.dtype, q.device)
    dk = tu.alloc(k.shape, k.dtype, k.device)
    dv = tu.alloc(v.shape, v.dtype, v.device)
    if tu.fused_backward(lse.shape[-1], S, D, q.dtype, capability=tu.capability(q.device)):
        dw = tu.alloc((B, H, R), lse.dtype, q.device)
        bwd_fused_launch(do, q, k, v, weights, lse, dq, dk, dv, dw, scale=scale).run()
        return dq, dk, dv, dw.sum(dim=1).to(weights.dtype)
    delta = tu.alloc(lse.shape, lse.dtype, q.device)  # [B, H, R, GQ]
    for launch in bwd_launches(do, q, k, v, weights, lse, delta, dq, dk, dv, scale=scale):
        launch.run()  # dq first: the dk/dv kernel reads the delta it writes
    dweights = delta.sum(dim=(1, 3)).to(weights.dtype)  # [B, R]: sum over kv heads and their G*Q rows
    return dq, dk, dv, dweights

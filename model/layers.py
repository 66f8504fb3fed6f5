"""Building blocks of the GCA model: RMSNorm, SwiGLU, sliding-window self-attention (ALiBi or RoPE), the chunk
encoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.swa import alibi_slopes, sliding_window_attention
from model.config import GCAConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (fp64 for fp64 inputs): bf16 sums of squares lose the small components.
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class KVCache:
    """The last ``window`` stream positions of one layer's keys and values, or all of them for full attention
    (streaming inference only)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, <=W, H, D]
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return cache + new keys/values (what the new queries attend to) and keep the last ``window`` (``None``:
        keep every position)."""
        if self.k is not None and self.v is not None:
            k = torch.cat([self.k, k], dim=1)
            v = torch.cat([self.v, v], dim=1)
        self.k, self.v = (k, v) if window is None else (k[:, -window:], v[:, -window:])
        return k, v


@dataclass(frozen=True)
class WindowPositions:
    """What the sliding-window attention needs to know about one step's stream positions besides their order."""

    index: torch.Tensor | None = None
    """``[L]`` RoPE position of every stream position of the step (``model.position=rope``), else ``None``."""
    landmark: torch.Tensor | None = None
    """``[L]`` true at the landmarks (``model.tokens_see_landmarks=false``: hidden from real tokens), else ``None``."""


def window_positions(cfg: GCAConfig, start: int, length: int, device: torch.device, landmarks: bool) -> WindowPositions:
    """``WindowPositions`` of the stream positions ``start .. start + length - 1``. With ``landmarks`` (the GCA
    model) the stream holds a landmark after every ``chunk_size`` tokens: a real token's RoPE position is its index
    in the text and a landmark takes the next token's, so two tokens are as far apart as in the text (what a
    converted dense model saw). Without (the ``swa`` baseline) stream and text positions are the same."""
    if cfg.position == "alibi" and (cfg.tokens_see_landmarks or not landmarks):
        return WindowPositions()
    p = start + torch.arange(length, device=device)
    P = cfg.chunk_size + 1
    index = (p - p // P if landmarks else p) if cfg.position == "rope" else None
    hidden = landmarks and not cfg.tokens_see_landmarks
    return WindowPositions(index=index, landmark=p % P == P - 1 if hidden else None)


_HIDING_DIMS = 8
"""Head dimensions appended when landmarks are hidden from real tokens; 8 keeps FlashAttention's ``D % 8 == 0``."""
_HIDING_LOGIT = 2.0**14
"""Product of a token query's extra dimension (1) and a landmark key's (-2^14), exact in fp16/bf16/fp32: after the
``D^-0.5`` scale (head dims up to 256) it puts a landmark at least 1000 below the row's other logits, whose
exponential is then exactly 0."""


def hide_landmarks(q: torch.Tensor, k: torch.Tensor, landmark: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``_HIDING_DIMS`` dimensions to ``q [B, L, HQ, D]`` and ``k [B, L, H, D]`` so that a real token's
    query scores every landmark key ``-2^14`` lower and nothing else changes (every other product in those
    dimensions is 0). Every sliding-window backend computes this mask this way, with no kernel of its own."""
    token_query = (~landmark).to(q.dtype)[None, :, None, None]  # [1, L, 1, 1]
    landmark_key = landmark.to(k.dtype)[None, :, None, None] * -_HIDING_LOGIT
    q_extra = F.pad(token_query.expand(*q.shape[:-1], 1), (0, _HIDING_DIMS - 1))
    k_extra = F.pad(landmark_key.expand(*k.shape[:-1], 1), (0, _HIDING_DIMS - 1))
    return torch.cat([q, q_extra], dim=-1), torch.cat([k, k_extra], dim=-1)


class SlidingWindowAttention(nn.Module):
    """Causal self-attention over the last ``window`` stream positions (landmarks included, unless hidden from real
    tokens), with ALiBi or RoPE positions (``model.position``)."""

    slopes: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.window
        self.backend = cfg.swa_backend
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        # RoPE: slopes of 0 make the kernels' ALiBi bias vanish, leaving the plain windowed softmax.
        slopes = alibi_slopes(cfg.n_heads) if cfg.position == "alibi" else torch.zeros(cfg.n_heads)
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, pos: WindowPositions | None = None
    ) -> torch.Tensor:
        """``pos``: the step's ``WindowPositions`` (``None``: ALiBi with every position visible)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # [B, T, HQ, D]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, H, D]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        pos = pos or WindowPositions()
        if pos.index is not None:  # rotated before caching: a cached key keeps the rotation of its own position
            dtype = torch.promote_types(x.dtype, torch.float32)
            cos, sin = rope_tables_at(pos.index, self.head_dim, self.rope_theta, dtype)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if pos.landmark is not None:
            q, k = hide_landmarks(q, k, pos.landmark)  # the cache keeps the keys' extra dimensions
        if cache is not None:
            k, v = cache.extend(k, v, self.window)  # [B, Tcache + T, H, D]
        scale = None  # the kernels' default, D^-0.5
        if pos.landmark is not None:
            v = F.pad(v, (0, _HIDING_DIMS))
            scale = self.head_dim**-0.5  # of the real head dimension, not of the padded one
        o = sliding_window_attention(
            q, k, v, window=self.window, alibi_slopes=self.slopes, scale=scale, backend=self.backend
        )
        return self.wo(o[..., : self.head_dim].reshape(B, T, -1))


class DecoderLayer(nn.Module):
    """Pre-norm sliding-window layer: ``h + SWA(norm(h))`` then ``+ MLP(norm(.))``."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = SlidingWindowAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(
        self, h: torch.Tensor, cache: KVCache | None = None, pos: WindowPositions | None = None
    ) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cache, pos)
        return h + self.mlp(self.mlp_norm(h))


def rope_tables(
    length: int, head_dim: int, theta: float, start: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines ``[length, D/2]`` of the rotary angles at positions ``start .. start + length - 1``,
    computed in ``dtype`` (fp32, or fp64 for fp64 inputs), for ``rotate``; made once per layer for its queries and
    keys alike. The chunk encoder restarts at 0 in every chunk; the full-attention model passes the stream position
    of its first token."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)  # [D/2]
    angles = torch.arange(start, start + length, device=device, dtype=dtype)[:, None] * inv_freq  # [P, D/2]
    return angles.cos(), angles.sin()


def rope_tables_at(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables`` at arbitrary integer ``positions [P]`` (the sliding window's), cast to ``dtype``. The angles
    are computed in fp64: at position 10^6 an fp32 angle is off by up to 0.06 rad, and the sliding window must read
    the same far into a long input as near its start."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq  # [P, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs of dimensions (0, 1), (2, 3), ... of ``x [..., P, H, D]`` by angles whose cosines and sines
    are ``[P, D/2]``, in their dtype."""
    dtype = cos.dtype
    cos, sin = cos[:, None, :], sin[:, None, :]  # [P, 1, D/2]
    x1, x2 = x.to(dtype).unflatten(-1, (-1, 2)).unbind(-1)  # a view: its backward is one stack, not two slices
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # [..., P, H, D/2, 2]
    return out.flatten(-2).to(x.dtype)


class EncoderLayer(nn.Module):
    """Bidirectional pre-norm layer over the S+1 positions of one chunk, RoPE positions."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_theta = cfg.n_heads, cfg.head_dim, cfg.rope_theta
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        NC, P, Dm = h.shape  # [B*N, S+1, d_model]
        q, k, v = self.wqkv(self.attn_norm(h)).view(NC, P, 3, self.n_heads, self.head_dim).unbind(2)
        cos, sin = rope_tables(
            P, self.head_dim, self.rope_theta, 0, h.device, torch.promote_types(h.dtype, torch.float32)
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [B*N, S+1, HQ, D]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = h + self.wo(o.transpose(1, 2).reshape(NC, P, Dm))
        return h + self.mlp(self.mlp_norm(h))


class ChunkEncoder(nn.Module):
    """Encodes each chunk (S tokens + landmark) into a landmark key and the chunk's K/V memory.

    The memory projections are shared by every upper layer of every group; the landmark
    slot is never part of the memory (only its key is used, for retrieval).
    """

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.n_kv_heads, self.head_dim = cfg.n_kv_heads, cfg.head_dim
        self.prenorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mem_k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.mem_v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)

    def forward(self, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``chunks [B, N, S+1, d_model]`` (landmark last) -> keys ``[B, N, d_model]``, k/v ``[B, N, S, H, D]``."""
        B, N, P, Dm = chunks.shape
        h = self.prenorm(chunks.reshape(B * N, P, Dm))
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h).view(B, N, P, Dm)
        landmark_keys = h[:, :, -1]  # [B, N, d_model]
        body = h[:, :, :-1]  # [B, N, S, d_model]
        mem_k = self.mem_k(body).view(B, N, P - 1, self.n_kv_heads, self.head_dim)  # [B, N, S, H, D]
        mem_v = self.mem_v(body).view(B, N, P - 1, self.n_kv_heads, self.head_dim)
        return landmark_keys, mem_k, mem_v

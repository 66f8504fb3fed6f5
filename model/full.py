"""The full-attention baseline (``model.arch=full``): a standard causal transformer with RoPE.

Same width, heads (grouped-query ``n_kv_heads``), SwiGLU MLP, RMSNorm and initialisation as the other models, and the
sliding-window baseline's layer count (``n_lower_layers + sum(groups) + n_encoder_layers``). Every token attends to
every earlier token, rotary positions are absolute stream positions (base ``rope_theta``), and attention is PyTorch's
``scaled_dot_product_attention``. It answers "what does a model that sees everything do past its training length?".
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.chunk_store import ChunkStore
from model.config import GCAConfig
from model.layers import KVCache, RMSNorm, SwiGLU, rope_tables, rotate
from model.lm import CausalLM
from model.stream import StreamState

_MASK_ELEMENTS = 1 << 24
"""Query x key mask elements per attention call when new queries continue a cache. PyTorch's CPU SDPA turns a
boolean mask into a float one of the same shape (and a lower-right ``CausalBias`` into a dense mask), so a 4096-token
segment over a 64K-token cache would allocate 1 GiB per layer; in query blocks it stays near 80 MB."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q [B, T, HQ, D]``, the last ``T`` of the ``S`` positions of ``k, v [B, S, H, D]``
    (``HQ`` a multiple of ``H``): query ``i`` sees keys ``0 .. S - T + i``. Returns ``[B, T, HQ, D]``."""
    T, S = q.shape[1], k.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, positions, D]
    gqa = q.shape[1] != k.shape[1]
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2)
    rows = max(1, _MASK_ELEMENTS // S)
    parts = []
    for first in range(0, T, rows):
        last = min(T, first + rows)
        visible = S - T + last  # keys the block's last query sees
        mask = torch.ones(last - first, visible, dtype=torch.bool, device=q.device).tril(visible - (last - first))
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, first:last], k[:, :, :visible], v[:, :, :visible], attn_mask=mask, enable_gqa=gqa
            )
        )
    return torch.cat(parts, dim=2).transpose(1, 2)


class FullAttention(nn.Module):
    """Causal self-attention over every earlier stream position, RoPE on queries and keys."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, start: int, cache: KVCache | None = None) -> torch.Tensor:
        """``x [B, T, d_model]`` at stream positions ``start .. start + T - 1``; ``cache`` holds the earlier ones."""
        B, T, _ = x.shape
        cos, sin = rope_tables(
            T, self.head_dim, self.rope_theta, start, x.device, torch.promote_types(x.dtype, torch.float32)
        )
        q = rotate(self.wq(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = rotate(self.wk(x).view(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if cache is not None:
            k, v = cache.extend(k, v, window=None)  # [B, start + T, H, D]
        return self.wo(causal_attention(q, k, v).reshape(B, T, -1))


class FullAttentionLayer(nn.Module):
    """Pre-norm layer: ``h + Attn(norm(h))`` then ``+ MLP(norm(.))``."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = FullAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, h: torch.Tensor, start: int, cache: KVCache | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), start, cache)
        return h + self.mlp(self.mlp_norm(h))


class FullAttentionLM(CausalLM):
    """Causal LM of full-attention RoPE layers with a tied head; the same interface as ``GCAForCausalLM``."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(FullAttentionLayer(cfg) for _ in range(cfg.n_baseline_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_normal_weights()

    def new_stream_state(self, memory: ChunkStore | None = None) -> StreamState:
        """Only the per-layer caches (every key and value so far) are used; ``memory`` is accepted for interface
        parity."""
        return StreamState(n_layers=len(self.layers), n_groups=0, memory=memory)

    def forward_stream(
        self, input_ids: torch.Tensor, state: StreamState, last_logits: int | None = None, memory_only: bool = False
    ) -> torch.Tensor:
        """As ``GCAForCausalLM.forward_stream``. ``memory_only`` runs every layer (their caches are what later
        tokens read) and skips only the LM head."""
        return self._step(input_ids, state, last_logits, memory_only)

    @property
    def window_reach(self) -> int:
        """Every token stays visible after ``memory_only`` steps, so the next token's logits are already exact."""
        return 1

    def _step(
        self,
        input_ids: torch.Tensor,
        state: StreamState | None,
        last_logits: int | None = None,
        memory_only: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens]; got shape {tuple(input_ids.shape)}")
        start = state.n_tokens if state is not None else 0
        h = self.embed(input_ids)  # [B, T, d_model]
        caches = state.caches if state is not None else [None] * len(self.layers)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, start, cache)
        if state is not None:
            state.n_tokens += input_ids.shape[1]
        if memory_only:
            return h.new_empty(input_ids.shape[0], 0, self.cfg.vocab_size)
        if last_logits is not None:
            h = h[:, max(0, h.shape[1] - last_logits) :]
        h = self.norm(h)
        return h if hidden else self.lm_head(h)

"""The sliding-window baseline (``model.arch=swa``): GCA's decoder without chunk encoder and retrieval.

Same width, heads, window and positions (``model.position``); its layer count is the GCA model's lower + upper +
encoder layers, so the two have a similar parameter budget. It answers "what does retrieval add?": anything
farther back than its receptive field (layers x window) is invisible to it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from model.chunk_store import ChunkStore
from model.config import GCAConfig
from model.layers import DecoderLayer, KVCache, RMSNorm, window_positions
from model.lm import CausalLM
from model.stream import StreamState


class SlidingWindowLM(CausalLM):
    """Causal LM of sliding-window layers with a tied head; the same interface as ``GCAForCausalLM``."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_baseline_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_normal_weights()

    def new_stream_state(self, memory: ChunkStore | None = None) -> StreamState:
        """Only the per-layer window caches are used; ``memory`` is accepted for interface parity."""
        return StreamState(n_layers=len(self.layers), n_groups=0, memory=memory)

    def forward_stream(
        self, input_ids: torch.Tensor, state: StreamState, last_logits: int | None = None, memory_only: bool = False
    ) -> torch.Tensor:
        """As ``GCAForCausalLM.forward_stream``. This model has no long-range memory: ``memory_only`` only counts
        the tokens and empties the windows, and logits are exact again after ``window_reach`` tokens."""
        if memory_only:
            state.n_tokens += input_ids.shape[1]
            state.caches[:] = [KVCache() for _ in self.layers]
            return self.embed.weight.new_empty(input_ids.shape[0], 0, self.cfg.vocab_size)
        return self._step(input_ids, state, last_logits)

    @property
    def window_reach(self) -> int:
        """The receptive field in tokens: every logit depends on this many tokens, itself included."""
        return len(self.layers) * self.cfg.window + 1

    def _step(
        self, input_ids: torch.Tensor, state: StreamState | None, last_logits: int | None = None, hidden: bool = False
    ) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens]; got shape {tuple(input_ids.shape)}")
        h = self.embed(input_ids)  # [B, T, d_model]
        caches = state.caches if state is not None else [None] * len(self.layers)
        start = state.n_tokens if state is not None else 0
        pos = window_positions(self.cfg, start, input_ids.shape[1], h.device, landmarks=False)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, cache, pos)
        if state is not None:
            state.n_tokens += input_ids.shape[1]
        if last_logits is not None:
            h = h[:, max(0, h.shape[1] - last_logits) :]
        h = self.norm(h)
        return h if hidden else self.lm_head(h)

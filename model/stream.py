"""State carried between forward steps when a long input is processed piece by piece (segments or tokens).

Holds exactly what the next step needs and nothing that grows with the input except the chunk memory:
the last ``window`` keys/values of every self-attention layer, the lower-layer states of the unfinished chunk,
each group's current retrieval row, and the chunk memory (landmark keys plus chunk K/V).
"""

from __future__ import annotations

import torch

from model.layers import KVCache
from model.retrieval import RetrievalRows


class ChunkMemory:
    """Landmark keys ``[B, C, d_model]`` and chunk memories ``[B, C, S, H, D]``, appended chunk by chunk.

    Storage grows by doubling so that appending one chunk at a time costs amortised O(1) copies.
    """

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.size = 0

    def append(self, keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = keys.shape[1]
        if n == 0:
            return
        if self._keys is None or self.size + n > self._keys.shape[1]:
            capacity = max(self.size + n, 2 * (self._keys.shape[1] if self._keys is not None else 0), 16)
            self._keys = self._grow(self._keys, keys, capacity)
            self._k = self._grow(self._k, k, capacity)
            self._v = self._grow(self._v, v, capacity)
        self._keys[:, self.size : self.size + n] = keys
        self._k[:, self.size : self.size + n] = k
        self._v[:, self.size : self.size + n] = v
        self.size += n

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        new = like.new_empty((like.shape[0], capacity, *like.shape[2:]))
        if old is not None:
            new[:, : self.size] = old[:, : self.size]
        return new

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, : self.size]

    @property
    def k(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, : self.size]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, : self.size]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._keys, self._k, self._v) if t is not None)


class StreamState:
    """Everything a GCA model needs to continue a sequence; create it with ``model.new_stream_state()``."""

    def __init__(self, n_layers: int, n_groups: int, memory: ChunkMemory | None = None) -> None:
        self.n_tokens = 0
        self.caches = [KVCache() for _ in range(n_layers)]
        self.pending: torch.Tensor | None = None  # [B, <S, d_model] lower-layer states of the unfinished chunk
        self.rows: list[RetrievalRows | None] = [None] * n_groups
        self.memory = memory if memory is not None else ChunkMemory()

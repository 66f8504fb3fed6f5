"""State carried between forward steps when a long input is processed piece by piece (segments or tokens).

Holds exactly what the next step needs and nothing that grows with the input except the chunk memory:
the last ``window`` keys/values of every self-attention layer, the lower-layer states of the unfinished chunk,
each group's current retrieval row (or the query it is scored from), and the chunk memory (landmark keys plus
chunk K/V).
"""

from __future__ import annotations

import torch

from model.chunk_store import AppendBuffer, ChunkStore
from model.layers import KVCache
from model.retrieval import DeferredRow, Picks, RetrievalRows


class ChunkMemory:
    """The in-RAM (or on-GPU) ``ChunkStore``: landmark keys ``[B, C, d_model]`` and chunk memories
    ``[B, C, S, H, D]`` in tensors grown by doubling."""

    def __init__(self) -> None:
        self._keys, self._k, self._v = AppendBuffer(dim=1), AppendBuffer(dim=1), AppendBuffer(dim=1)

    @property
    def size(self) -> int:
        return self._keys.size

    def append(self, keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if keys.shape[1] == 0:
            return
        self._keys.append(keys)
        self._k.append(k)
        self._v.append(v)

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys.view() if self.size else None

    @property
    def k(self) -> torch.Tensor | None:
        return self._k.view() if self.size else None

    @property
    def v(self) -> torch.Tensor | None:
        return self._v.view() if self.size else None

    def nbytes(self) -> int:
        return self._keys.nbytes() + self._k.nbytes() + self._v.nbytes()


class StreamState:
    """Everything a GCA model needs to continue a sequence; create it with ``model.new_stream_state()``."""

    def __init__(self, n_layers: int, n_groups: int, memory: ChunkStore | None = None) -> None:
        self.n_tokens = 0
        self.caches = [KVCache() for _ in range(n_layers)]
        self.pending: torch.Tensor | None = None  # [B, <S, d_model] lower-layer states of the unfinished chunk
        # Each group's current row; after memory_only steps the last landmark's query, scored when read.
        self.rows: list[RetrievalRows | DeferredRow | None] = [None] * n_groups
        self.memory: ChunkStore = memory if memory is not None else ChunkMemory()
        # model.retrieval_scope=document: end-of-document tokens seen so far ([B]) and the documents of every stored
        # chunk (``ChunkDocuments`` rows, [B, C] each, C growing with the memory).
        self.eos_count: torch.Tensor | None = None
        self.read_docs, self.key_docs = AppendBuffer(dim=1), AppendBuffer(dim=1)
        # None, or (set to {} by a caller) every retrieval scored from here on (``model.retrieval.record_picks``).
        # Diagnostics only (which chunks a two-hop question fetched, far recall).
        self.picks: Picks | None = None

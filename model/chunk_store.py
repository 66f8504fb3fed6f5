"""The chunk-memory interface the model reads through, and the growable buffer its stores append into.

A ``ChunkStore`` holds, for every completed chunk, its landmark key (``[B, C, d_model]``, scored in full at every
retrieval) and its K/V memory (``[B, C, S, H, D]``, of which a step gathers only the retrieved chunks with
``k[batch, index]``). ``model.stream.ChunkMemory`` keeps everything in tensors; ``model.offload.MemmapChunkMemory``
moves the K/V to a file past a size. The model touches a store only through this protocol, so any store gives the
same logits.
"""

from __future__ import annotations

from typing import Protocol

import torch

_MIN_CAPACITY = 16
"""Chunks allocated at the first append: short inputs never regrow."""


class ChunkGather(Protocol):
    """Chunk K/V as the model reads them: a shape ``[B, C, S, H, D]`` and the gather ``t[batch, index]``
    (``batch [B, 1, 1]``, ``index [B, Cq, R]`` -> ``[B, Cq, R, S, H, D]``). A tensor is one."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, idx: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...


class ChunkStore(Protocol):
    """Landmark keys and chunk K/V of every chunk completed so far, appended chunk by chunk."""

    @property
    def size(self) -> int:
        """Chunks stored."""
        ...

    def append(self, keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``n`` chunks: ``keys [B, n, d_model]``, ``k, v [B, n, S, H, D]``."""
        ...

    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, size, d_model]``, or ``None`` before the first append."""
        ...

    @property
    def k(self) -> ChunkGather | None:
        """Chunk keys ``[B, size, S, H, D]``, or ``None`` before the first append."""
        ...

    @property
    def v(self) -> ChunkGather | None:
        """Chunk values ``[B, size, S, H, D]``, or ``None`` before the first append."""
        ...

    def nbytes(self) -> int:
        """Bytes the store holds (allocated capacity, on disk included)."""
        ...


def next_capacity(needed: int, capacity: int) -> int:
    """The capacity to grow to when ``needed`` elements no longer fit in ``capacity``: at least double, so that
    appending one chunk at a time costs amortised O(1) copies."""
    return max(needed, 2 * capacity, _MIN_CAPACITY)


class AppendBuffer:
    """A tensor appended to along ``dim``, its storage grown with ``next_capacity``; ``view()`` is the filled
    part (a view, no copy)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.size = 0
        self._data: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._data is None else self._data.shape[self.dim]

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        if self._data is None or self.size + n > self.capacity:
            shape = list(x.shape)
            shape[self.dim] = next_capacity(self.size + n, self.capacity)
            grown = x.new_empty(shape)
            if self._data is not None:
                grown.narrow(self.dim, 0, self.size).copy_(self.view())
            self._data = grown
        self._data.narrow(self.dim, self.size, n).copy_(x)
        self.size += n

    def view(self) -> torch.Tensor:
        if self._data is None:
            raise ValueError("the buffer is empty: nothing was appended yet")
        return self._data.narrow(self.dim, 0, self.size)

    def nbytes(self) -> int:
        return 0 if self._data is None else self._data.numel() * self._data.element_size()

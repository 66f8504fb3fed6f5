"""A chunk memory that spills chunk K/V to an on-disk file, so evaluation at millions of tokens keeps RSS bounded.

A ``model.chunk_store.ChunkStore`` like the in-RAM ``model.stream.ChunkMemory``, so
``model.new_stream_state(memory=MemmapChunkMemory(...))`` gives exactly the logits of the in-RAM memory.

Why it bounds memory: a step that reads the memory scores landmark keys but gathers only the retrieved chunks
(``mem_k[batch, index]``). Landmark keys (``[B, C, d_model]``, 1/(2S) of the chunk store) stay where they arrive
(RAM or GPU). Chunk K/V stay in RAM up to ``ram_bytes``; then they move to a temp file (unlinked when created),
stored chunk-major (``[C, B, S, H, D]``) so that growing the file never moves what is already written. Appends go
through ``os.pwrite`` and reads ``pread`` exactly the picked chunks, so file data lives in the page cache, never in
this process's RSS (a memmap would keep every touched page mapped). Once on disk, ``k`` / ``v`` support what the
model does with them -- ``shape`` and the gather ``k[batch, index]`` -- not arbitrary tensor operations.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref

import torch

from model.chunk_store import AppendBuffer, ChunkGather, next_capacity


class _DeviceGather:
    """``t[batch, index]`` for host-resident ``t`` with indices on another device (GPU evaluation)."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device = host, device
        self.shape = host.shape

    def __getitem__(self, idx: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, index = idx
        return self.host[batch.cpu(), index.cpu()].to(self.device, non_blocking=True)


class _DiskGather:
    """``t[batch, index]`` for the on-disk chunk-major store: reads exactly the picked chunks with ``pread``.

    Reading through ``np.memmap`` would work too, but every page a step touches (plus the kernel's fault-around
    neighbours) stays in this process's RSS while the mapping lives, so RSS would track the file size.
    """

    def __init__(self, fd: int, size: int, chunk_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.fd, self.chunk_shape, self.dtype, self.device = fd, chunk_shape, dtype, device
        self.shape = torch.Size((chunk_shape[0], size, *chunk_shape[1:]))  # [B, C, S, H, D]

    def __getitem__(self, idx: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, index = (t.cpu() for t in idx)
        index = torch.as_tensor(index)
        if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < self.shape[1]:
            raise IndexError(f"chunk index out of range [0, {self.shape[1]})")
        chunks, inverse = torch.unique(index.reshape(-1), return_inverse=True)
        buf = torch.empty((len(chunks), *self.chunk_shape), dtype=self.dtype)  # [U, B, S, H, D]
        raw = buf.view(-1).view(torch.uint8).numpy().data
        step = len(raw) // max(len(chunks), 1)
        for i, c in enumerate(chunks.tolist()):
            _pread_into(self.fd, raw[i * step : (i + 1) * step], c * step)
        out = buf[inverse.view(index.shape), torch.as_tensor(batch).expand(index.shape)]  # [B, C, R, S, H, D]
        return out.to(self.device, non_blocking=True)


class MemmapChunkMemory:
    """Landmark keys ``[B, C, d_model]`` in RAM; chunk K/V ``[B, C, S, H, D]`` in RAM up to ``ram_bytes``, then
    in temp files whose names are removed as soon as they are created: their space is freed at ``close()``, garbage
    collection or the end of the process however it ends (a killed 16M-token run would otherwise leave ~16 GB).

    Args:
        ram_bytes: chunk K/V bytes kept in RAM before spilling to disk (0 = disk from the first chunk).
        directory: where the temp files go (default: the system temp dir).
    """

    def __init__(self, ram_bytes: int = 1 << 30, directory: str | os.PathLike | None = None) -> None:
        if ram_bytes < 0:
            raise ValueError(f"ram_bytes must be >= 0; got {ram_bytes}")
        self.ram_bytes = ram_bytes
        self.directory = directory
        self.size = 0
        self._keys = AppendBuffer(dim=1)  # [B, C, d_model]
        self._ram: dict[str, AppendBuffer] = {}  # "k"/"v" -> chunk-major [C, B, S, H, D] until spilled
        self._files: dict[str, int] = {}  # "k"/"v" -> fd once spilled
        self._views: dict[str, ChunkGather] = {}
        self._capacity = 0  # chunks the files have room for
        self._chunk_shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self._device = torch.device("cpu")
        self._finalizer: weakref.finalize | None = None

    @property
    def on_disk(self) -> bool:
        return bool(self._files)

    def append(self, keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = keys.shape[1]
        if n == 0:
            return
        if self.size == 0:
            self._chunk_shape, self._dtype, self._device = (k.shape[0], *k.shape[2:]), k.dtype, k.device
        self._keys.append(keys)
        self._append_kv("k", k)
        self._append_kv("v", v)
        self.size += n
        self._views.clear()

    def _chunk_bytes(self) -> int:
        return math.prod(self._chunk_shape) * torch.empty((), dtype=self._dtype).element_size()

    def _append_kv(self, name: str, x: torch.Tensor) -> None:
        n = x.shape[1]
        chunk_major = x.detach().transpose(0, 1).to("cpu").contiguous()  # [n, B, S, H, D]
        if not self._files and 2 * (self.size + n) * self._chunk_bytes() > self.ram_bytes:
            self._spill()
        if self._files:
            if self.size + n > self._capacity:
                self._capacity = next_capacity(self.size + n, self._capacity)
                for fd in self._files.values():
                    os.ftruncate(fd, self._capacity * self._chunk_bytes())  # sparse: no bytes written
            _pwrite_all(self._files[name], chunk_major, self.size * self._chunk_bytes())
            return
        self._ram.setdefault(name, AppendBuffer(dim=0)).append(chunk_major)

    def _spill(self) -> None:
        """Move the chunk K/V written so far from RAM to fresh temp files, unlinked at once (reached by fd only)."""
        self._finalizer = weakref.finalize(self, _cleanup, self._files)
        self._capacity = next_capacity(self.size, 0)
        for name in ("k", "v"):
            fd, path = tempfile.mkstemp(prefix=f"gca-chunk-memory-{name}-", dir=self.directory)
            os.unlink(path)
            self._files[name] = fd
            os.ftruncate(fd, self._capacity * self._chunk_bytes())
            if self.size:
                _pwrite_all(fd, self._ram[name].view(), 0)
        self._ram.clear()

    def _view(self, name: str) -> ChunkGather | None:
        if self.size == 0:
            return None
        if name not in self._views:
            if self._files:
                self._views[name] = _DiskGather(
                    self._files[name], self.size, self._chunk_shape, self._dtype, self._device
                )
            else:
                host = self._ram[name].view().transpose(0, 1)  # [B, C, S, H, D]
                self._views[name] = host if self._device.type == "cpu" else _DeviceGather(host, self._device)
        return self._views[name]

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys.view() if self.size else None

    @property
    def k(self) -> ChunkGather | None:
        return self._view("k")

    @property
    def v(self) -> ChunkGather | None:
        return self._view("v")

    def nbytes(self) -> int:
        """Bytes held by the memory, on disk included (the file's logical size)."""
        return self.ram_nbytes() + len(self._files) * self._capacity * self._chunk_bytes()

    def ram_nbytes(self) -> int:
        """Bytes held in RAM (or on the GPU for the keys): landmark keys plus unspilled chunk K/V."""
        return self._keys.nbytes() + sum(buf.nbytes() for buf in self._ram.values())

    def close(self) -> None:
        """Delete the on-disk store; the memory is empty afterwards."""
        self._views.clear()
        if self._finalizer is not None:
            self._finalizer()
        self._keys, self._ram, self._files, self.size, self._capacity = AppendBuffer(dim=1), {}, {}, 0, 0

    def __enter__(self) -> MemmapChunkMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pwrite_all(fd: int, x: torch.Tensor, offset: int) -> None:
    """Write the bytes of contiguous ``x`` at ``offset``; ``os.pwrite`` may write less than asked (> 2 GiB)."""
    # A uint8 view reinterprets any dtype (bf16 included, which numpy lacks) as raw bytes.
    raw = x.reshape(-1).view(torch.uint8).numpy().data
    while raw:
        written = os.pwrite(fd, raw, offset)
        raw, offset = raw[written:], offset + written


def _pread_into(fd: int, out: memoryview, offset: int) -> None:
    while out:
        n = os.preadv(fd, [out], offset)
        if n == 0:
            raise OSError(f"chunk memory file ended early at byte {offset}")
        out, offset = out[n:], offset + n


def _cleanup(files: dict[str, int]) -> None:
    """Close the unlinked files: the kernel frees their space."""
    for fd in files.values():
        os.close(fd)
    files.clear()

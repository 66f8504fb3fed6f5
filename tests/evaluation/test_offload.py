"""MemmapChunkMemory gives the logits of the in-RAM ChunkMemory, spills to disk past its budget, cleans up."""

import os

import pytest
import torch
from helpers import EXACT, assert_close

from model.offload import MemmapChunkMemory
from model.stream import ChunkMemory


def _stream(model, ids, memory, segment):
    state = model.new_stream_state(memory=memory)
    with torch.inference_mode():
        pieces = [model.forward_stream(ids[:, s : s + segment], state) for s in range(0, ids.shape[1], segment)]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("ram_bytes", [0, 40_000, 1 << 30], ids=["disk-from-start", "spill-midway", "ram-only"])
def test_same_logits_as_chunk_memory(tiny_model, tmp_path, ram_bytes):
    ids = torch.randint(0, 256, (2, 700))  # batch 2: the chunk-major disk layout must keep batches apart
    reference = _stream(tiny_model, ids, ChunkMemory(), segment=96)
    with MemmapChunkMemory(ram_bytes=ram_bytes, directory=tmp_path) as memory:
        got = _stream(tiny_model, ids, memory, segment=96)
        assert memory.on_disk == (ram_bytes < 1 << 30)
        assert memory.size == 700 // 16
    assert_close(got, reference, EXACT)


def test_token_by_token_and_views(tmp_path):
    ref, mem = ChunkMemory(), MemmapChunkMemory(ram_bytes=3000, directory=tmp_path)
    for _ in range(40):  # one chunk at a time, growing the file repeatedly
        keys, k, v = torch.randn(2, 1, 8), torch.randn(2, 1, 4, 2, 3), torch.randn(2, 1, 4, 2, 3)
        ref.append(keys, k, v)
        mem.append(keys, k, v)
    assert mem.on_disk and mem.ram_nbytes() < ref.nbytes()
    assert_close(mem.keys, ref.keys, EXACT)
    batch = torch.arange(2)[:, None, None]
    every = torch.arange(40).view(1, 40, 1).expand(2, 40, 1)
    for index in (every, torch.tensor([[[3, 0], [39, 17]], [[5, 5], [1, 38]]])):
        assert_close(mem.k[batch, index], ref.k[batch, index], EXACT)
        assert_close(mem.v[batch, index], ref.v[batch, index], EXACT)
    assert mem.k.shape == ref.k.shape
    with pytest.raises(IndexError, match="out of range"):
        mem.k[batch, torch.full((2, 1, 1), 40)]
    mem.close()


def test_nothing_left_on_disk_after_close_or_a_kill(tmp_path):
    """The spilled files are unlinked when created: a process killed with SIGKILL (no cleanup code runs) leaves
    nothing behind either (a killed 16M-token passkey run holds ~16 GB there)."""
    import subprocess
    import sys

    mem = MemmapChunkMemory(ram_bytes=0, directory=tmp_path)
    mem.append(torch.randn(1, 2, 8), torch.randn(1, 2, 4, 2, 3), torch.randn(1, 2, 4, 2, 3))
    assert mem.on_disk and mem.nbytes() > mem.ram_nbytes() and os.listdir(tmp_path) == []
    mem.close()
    assert mem.size == 0 and mem.keys is None

    child = (
        "import os, signal, sys, torch\n"
        "from model.offload import MemmapChunkMemory\n"
        "mem = MemmapChunkMemory(ram_bytes=0, directory=sys.argv[1])\n"
        "mem.append(torch.randn(1, 64, 8), torch.randn(1, 64, 16, 2, 8), torch.randn(1, 64, 16, 2, 8))\n"
        "one = torch.ones(1, 1, 1, dtype=torch.long)\n"
        "assert mem.on_disk and mem.k[one - 1, one].abs().sum() > 0\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    assert os.listdir(tmp_path) == []


def test_bf16_round_trip(tmp_path):
    with MemmapChunkMemory(ram_bytes=0, directory=tmp_path) as mem:
        k = torch.randn(1, 3, 4, 2, 3).bfloat16()
        mem.append(torch.randn(1, 3, 8).bfloat16(), k, k)
        got = mem.k[torch.zeros(1, 1, 1, dtype=torch.long), torch.tensor([[[2, 0, 1]]])]
        assert got.dtype == torch.bfloat16
        assert_close(got[0, 0], k[0, [2, 0, 1]], EXACT)


def test_device_gather_moves_only_the_picked_chunks():
    """GPU evaluation path (untestable here without CUDA): host K/V, indices and result on the model's device."""
    from model.offload import _DeviceGather

    host = torch.randn(2, 10, 4, 2, 3)
    gather = _DeviceGather(host, torch.device("meta"))
    batch, index = torch.arange(2)[:, None, None], torch.tensor([[[1, 2]], [[9, 0]]])
    out = gather[batch, index]
    assert out.device.type == "meta" and out.shape == (2, 1, 2, 4, 2, 3)

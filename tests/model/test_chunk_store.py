"""The growable buffer behind both chunk stores: contents equal a plain concatenation, capacity at least doubles."""

import torch

from model.chunk_store import AppendBuffer, next_capacity


def test_append_buffer_holds_the_concatenation_along_its_dim():
    for dim in (0, 1):
        buf = AppendBuffer(dim=dim)
        parts = [torch.randn(2, n, 3) if dim == 1 else torch.randn(n, 2, 3) for n in (1, 5, 16, 2, 40)]
        capacities = []
        for part in parts:
            buf.append(part)
            capacities.append(buf.capacity)
        assert torch.equal(buf.view(), torch.cat(parts, dim=dim))
        assert buf.size == 64
        assert capacities == [16, 16, 32, 32, 64]
        assert buf.nbytes() == 64 * 2 * 3 * 4


def test_capacity_grows_geometrically():
    assert next_capacity(1, 0) == 16
    assert next_capacity(17, 16) == 32
    assert next_capacity(100, 32) == 100
    appends, copies, capacity = 0, 0, 0
    for size in range(1, 10_001):  # one chunk at a time: amortised O(1) copied chunks per append
        if size > capacity:
            copies += capacity
            capacity = next_capacity(size, capacity)
        appends += 1
    assert copies < 2 * appends

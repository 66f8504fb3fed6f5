"""Fixtures for kernel tests."""

import pytest
import torch


@pytest.fixture
def nan_kernel_outputs(monkeypatch):
    """Fill every buffer the Triton GCA wrappers allocate with NaN, so a tile no program writes fails the test."""
    from kernels.gca import triton_utils

    def alloc_nan(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_utils, "alloc", alloc_nan)

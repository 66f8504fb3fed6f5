"""Shared test setup.

On a machine without CUDA, Triton kernels run under the interpreter. The variable must be set before any
module that defines ``@triton.jit`` functions is imported, which is why it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield

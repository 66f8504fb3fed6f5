"""Tiny models and exports for the evaluation tests (naive backend, CPU, a few seconds each)."""

import pytest
import torch
from helpers import tiny_config

from model import GCAForCausalLM, save_pretrained


@pytest.fixture
def tiny_model() -> GCAForCausalLM:
    torch.manual_seed(0)
    return GCAForCausalLM(tiny_config()).eval()


@pytest.fixture
def tiny_export(tmp_path, tiny_model):
    """A synthetic-vocab export (no tokenizer: the byte tokenizer is used)."""
    return save_pretrained(tiny_model, tmp_path / "export", extra={"train_seq_len": 128})

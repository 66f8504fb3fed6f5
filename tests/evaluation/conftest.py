"""Tiny models and exports for the evaluation tests (naive backend, CPU, a few seconds each)."""

import pytest
import torch

from model import GCAConfig, GCAForCausalLM, save_pretrained


def tiny_config(**overrides) -> GCAConfig:
    base = dict(vocab_size=256, d_model=64, n_heads=2, n_kv_heads=2, ffn_hidden=128, n_lower_layers=1,
                groups=[1], chunk_size=16, top_k=2, window=32, attn_backend="naive")
    return GCAConfig(**{**base, **overrides})


@pytest.fixture
def tiny_model() -> GCAForCausalLM:
    torch.manual_seed(0)
    return GCAForCausalLM(tiny_config()).eval()


@pytest.fixture
def tiny_export(tmp_path, tiny_model):
    """A synthetic-vocab export (no tokenizer: the byte tokenizer is used)."""
    return save_pretrained(tiny_model, tmp_path / "export", extra={"train_seq_len": 128})

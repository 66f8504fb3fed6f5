"""Fixtures of the Hugging Face export tests (see ``hf_export_helpers``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_export_helpers import make_export, trained_tokenizer

from model import GCAForCausalLM


@pytest.fixture(scope="session")
def bpe_tokenizer() -> bytes:
    return trained_tokenizer("bpe", 400)


@pytest.fixture(scope="session")
def hf_export(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer: bytes) -> tuple[GCAForCausalLM, Path]:
    """``(native model, export dir)`` with the BPE tokenizer."""
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_proto=bpe_tokenizer).get_piece_size()
    return make_export(tmp_path_factory.mktemp("hf") / "export", bpe_tokenizer, vocab)

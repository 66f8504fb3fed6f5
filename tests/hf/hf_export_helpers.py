"""What the Hugging Face export tests share: sample text, a SentencePiece tokenizer trained the way data prep trains
one, and tiny random-init exports (grouped-query heads, two retrieval groups) made Hugging Face folders.

Imported as ``hf_export_helpers`` (pytest puts ``tests/hf`` on ``sys.path`` for its ``conftest.py``)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from helpers import tiny_config

from data_prep.config import TokenizerConfig
from data_prep.tokenize import train_tokenizer
from model import GCAConfig, GCAForCausalLM, save_pretrained
from pipeline.evaluation.haystack import WORDS
from pipeline.hf import write_hf_files

# Text with accents, CJK, an emoji, tabs, runs of spaces, digits and blank lines: what a lossless tokenizer keeps.
SAMPLE_WORDS = (*WORDS, "über", "café", "北京", "γράμμα", "🙂", "tab\tinside", "two  spaces", "3.14159", "\n\n", "x=1;")


def sample_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(SAMPLE_WORDS) for _ in range(rng.randint(5, 120))) for _ in range(n)]


def trained_tokenizer(model_type: str, vocab_size: int) -> bytes:
    return train_tokenizer(sample_texts(400, seed=1), TokenizerConfig(vocab_size=vocab_size, model_type=model_type), 1)


def hf_model_config(vocab_size: int) -> GCAConfig:
    """Grouped-query heads (4 query heads over 2 key/value heads), two retrieval groups, PyTorch operators."""
    return tiny_config(
        vocab_size=vocab_size,
        n_heads=4,
        n_kv_heads=2,
        groups=[1, 1],
        chunk_size=8,
        window=16,
        gca_backend="matmul",
        swa_backend="sdpa",
        init_std=0.2,  # spread-out logits, so greedy decoding does not repeat one token
    )


def make_export(
    directory: Path, tokenizer: bytes | None, vocab_size: int, seed: int = 0
) -> tuple[GCAForCausalLM, Path]:
    """A random-init model saved by ``save_pretrained`` (as the trainer does), plus the HF files."""
    torch.manual_seed(seed)
    model = GCAForCausalLM(hf_model_config(vocab_size)).eval()
    extra: dict[str, object] = {"seq_len": 64}
    if tokenizer is not None:
        directory.mkdir(parents=True)
        (directory / "tokenizer.model").write_bytes(tokenizer)
        extra["tokenizer"] = "tokenizer.model"
    save_pretrained(model, directory, extra=extra)
    write_hf_files(directory)
    return model, directory

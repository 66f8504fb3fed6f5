"""Loading an export for evaluation and streaming long inputs through it with bounded memory."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GCAForCausalLM, StreamState, load_pretrained, read_export_config
from model.offload import MemmapChunkMemory
from pipeline.evaluation.tokenizer import ByteTokenizer, SentencePieceTokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    path: str
    model: GCAForCausalLM
    tokenizer: SentencePieceTokenizer | ByteTokenizer
    train_seq_len: int | None
    """Training length from the export metadata (``train_seq_len``, or the trainer's ``seq_len``)."""


def load_checkpoint(path: str | Path, device: str = "cpu", attn_backend: str | None = None) -> Checkpoint:
    """Load an export directory (``config.json`` + ``model.safetensors``) in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not an export directory.
    """
    root = Path(path)
    missing = [n for n in ("config.json", "model.safetensors") if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {path} is not a model export (missing {', '.join(missing)}); "
                                "pass <run_dir>/export, written by the trainer or model.save_pretrained")
    cfg, export = read_export_config(root)
    overrides = {"attn_backend": attn_backend} if attn_backend else {}
    model = load_pretrained(root, device=device, **overrides)
    train_seq_len = export.get("train_seq_len", export.get("seq_len"))
    tokenizer = load_tokenizer(root, export, cfg.vocab_size)
    log.info("loaded %s: %.2fM parameters, chunk %d, window %d, trained at %s tokens, tokenizer %s",
             path, model.num_parameters() / 1e6, cfg.chunk_size, cfg.window, train_seq_len, tokenizer.name)
    return Checkpoint(str(path), model, tokenizer, int(train_seq_len) if train_seq_len else None)


@contextlib.contextmanager
def stream_state(model: GCAForCausalLM, offload_mb: int, offload_dir: str | None) -> Iterator[StreamState]:
    """A fresh stream state whose chunk K/V move to disk beyond ``offload_mb`` MiB (-1: never); cleaned up after."""
    if offload_mb < 0:
        yield model.new_stream_state()
        return
    memory = MemmapChunkMemory(ram_bytes=offload_mb << 20, directory=offload_dir)
    try:
        yield model.new_stream_state(memory=memory)  # type: ignore[arg-type]
    finally:
        memory.close()


def stream_segments(
    model: GCAForCausalLM,
    state: StreamState,
    ids: torch.Tensor,
    segment: int,
    on_tokens: Callable[[int], None] | None = None,
    last_only: bool = False,
    memory_only: bool = False,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``ids [B, T]`` in segments of ``segment`` tokens; yield ``(start, logits [B, t, V])`` per segment
    (``[B, 1, V]``, the segment's last position, with ``last_only``: skips the LM head for the rest; no logits
    with ``memory_only``, see ``GCAForCausalLM.forward_stream``)."""
    extra = {"memory_only": True} if memory_only else {}
    for start in range(0, ids.shape[1], segment):
        piece = ids[:, start : start + segment]
        with torch.inference_mode():
            logits = model.forward_stream(piece, state, last_logits=1 if last_only else None, **extra)
        if on_tokens is not None:
            on_tokens(piece.shape[1])
        yield start, logits

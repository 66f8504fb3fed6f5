"""Loading an export for evaluation and streaming long inputs through it with bounded memory."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from model import CausalLM, StreamState, load_pretrained, read_export_config
from model.io import ExportError
from model.offload import MemmapChunkMemory
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    path: str
    model: CausalLM
    tokenizer: ModelTokenizer | ByteTokenizer
    train_seq_len: int | None
    """Training length from the export metadata (``train_seq_len``, or the trainer's ``seq_len``)."""


def load_checkpoint(path: str | Path, device: str = "cpu", attn_backend: str | None = None) -> Checkpoint:
    """Load an export directory (``config.json`` + ``model.safetensors``) in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not an export directory.
        ValueError: a file of the export is malformed (``model.io.ExportError``, the tokenizer); the message names it.
    """
    root = Path(path)
    missing = [n for n in ("config.json", "model.safetensors") if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} is not a model export (missing {', '.join(missing)}); "
            "pass <run_dir>/export, written by the trainer or model.save_pretrained"
        )
    cfg, export = read_export_config(root)
    overrides = {"attn_backend": attn_backend} if attn_backend else {}
    model = load_pretrained(root, device=device, **overrides)
    train_seq_len = _train_seq_len(root, export)
    tokenizer = load_tokenizer(root, export, cfg.vocab_size)
    log.info(
        "loaded %s: %.2fM parameters, chunk %d, window %d, trained at %s tokens, tokenizer %s",
        path,
        model.num_parameters() / 1e6,
        cfg.chunk_size,
        cfg.window,
        train_seq_len,
        tokenizer.name,
    )
    return Checkpoint(str(path), model, tokenizer, train_seq_len)


def _train_seq_len(root: Path, export: dict) -> int | None:
    """The training length recorded in the export metadata (optional; only plots and reports use it)."""
    key = "train_seq_len" if "train_seq_len" in export else "seq_len"
    value = export.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ExportError(f"{root / 'config.json'}: export.{key}={value!r} must be a positive integer or absent")
    return value


def check_device(device: str, key: str = "device") -> None:
    """Refuse a device string torch cannot parse, or a CUDA device on a machine without one, before any work.

    Raises:
        ValueError: naming ``key`` and the value.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key}={device!r} is not a torch device; use cpu, cuda or cuda:<index>") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"{key}={device!r}: evaluation runs on cpu or cuda only")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}={device!r} but CUDA is not available here; use {key}=cpu")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{key}={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")


@dataclass(frozen=True)
class StreamBudget:
    """How a long input goes through the model: in segments (bounding activation memory) with the chunk memory
    spilling to disk past a size (bounding RAM). No setting changes a logit."""

    segment: int = 4096
    """Tokens per ``forward_stream`` call."""
    offload_mb: int = -1
    """MiB of chunk K/V kept in RAM per sequence before the rest goes to an on-disk memmap; -1 keeps all in RAM."""
    offload_dir: str | None = None
    """Where the memmap's temp dir goes (None: the system temp dir)."""


IN_RAM = StreamBudget()
"""4096-token segments, the chunk memory all in RAM: the library's default."""


@contextlib.contextmanager
def stream_state(model: CausalLM, budget: StreamBudget) -> Iterator[StreamState]:
    """A fresh stream state whose chunk K/V move to disk beyond ``budget.offload_mb`` MiB (-1: never); cleaned up
    after."""
    if budget.offload_mb < 0:
        yield model.new_stream_state()
        return
    memory = MemmapChunkMemory(ram_bytes=budget.offload_mb << 20, directory=budget.offload_dir)
    try:
        yield model.new_stream_state(memory=memory)
    finally:
        memory.close()


def stream_segments(
    model: CausalLM,
    state: StreamState,
    ids: torch.Tensor,
    segment: int,
    on_tokens: Callable[[int], None] | None = None,
    *,
    last_only: bool = False,
    memory_only: bool = False,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``ids [B, T]`` in segments of ``segment`` tokens; yield ``(start, logits [B, t, V])`` per segment
    (``[B, 1, V]``, the segment's last position, with ``last_only``: skips the LM head for the rest; no logits
    with ``memory_only``, see ``GCAForCausalLM.forward_stream``)."""
    for start in range(0, ids.shape[1], segment):
        piece = ids[:, start : start + segment]
        with torch.inference_mode():
            if memory_only:
                logits = model.forward_stream(piece, state, memory_only=True)
            else:
                logits = model.forward_stream(piece, state, last_logits=1 if last_only else None)
        if on_tokens is not None:
            on_tokens(piece.shape[1])
        yield start, logits

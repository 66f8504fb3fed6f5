"""Text <-> ids for evaluation prompts: the export's SentencePiece model, or UTF-8 bytes for a synthetic vocab.

An export written by the trainer names its tokenizer (``export.tokenizer``, relative to the export directory).
A model without one (e.g. random-init tests with a synthetic vocabulary) gets ``ByteTokenizer``: id = UTF-8
byte, which needs ``vocab_size >= 256``; needles and questions are then byte strings, so the passkey protocol
is the same code for both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    name: str
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        self.name = str(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class ByteTokenizer:
    """id = UTF-8 byte value; decoding replaces ids >= 256 (never produced by ``encode``) with U+FFFD."""

    name = "bytes"
    eos_id = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return b"".join(bytes([i]) if 0 <= i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", "replace")


def load_tokenizer(checkpoint: str | Path, export: dict, vocab_size: int) -> SentencePieceTokenizer | ByteTokenizer:
    """The tokenizer named by ``export["tokenizer"]``, else bytes.

    Raises:
        FileNotFoundError: the export names a tokenizer file that is not there.
        ValueError: ``export.tokenizer`` is not a file name, the file is not a SentencePiece model, or its
            vocabulary does not fit the model's ``vocab_size``.
    """
    name = export.get("tokenizer")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{checkpoint}/config.json: export.tokenizer={name!r} must be a file name")
    if name:
        path = Path(checkpoint) / name if not Path(name).is_absolute() else Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"{checkpoint}/config.json: export.tokenizer={name!r} but {path} does not exist")
        try:
            tok: SentencePieceTokenizer | ByteTokenizer = SentencePieceTokenizer(path)
        except (RuntimeError, OSError) as err:  # sentencepiece's parse error is a bare RuntimeError
            raise ValueError(
                f"{path}: not a SentencePiece model ({str(err).splitlines()[0]}); copy the dataset's "
                "tokenizer.model into the export again"
            ) from None
    else:
        tok = ByteTokenizer()
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}"
            + ("" if name else " (a model without export.tokenizer is fed UTF-8 bytes)")
        )
    return tok

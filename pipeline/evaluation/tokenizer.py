"""Text <-> ids for evaluation prompts: the export's tokenizer (a SentencePiece model or a Hugging Face
``tokenizer.json``), or UTF-8 bytes for a synthetic vocab.

An export written by the trainer names its tokenizer (``export.tokenizer``, relative to the export directory).
A model without one (e.g. random-init tests with a synthetic vocabulary) gets ``ByteTokenizer``: id = UTF-8
byte, which needs ``vocab_size >= 256``; needles and questions are then byte strings, so the passkey protocol
is the same code for both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from data_prep.dataset_tokenizer import TokenizerFiles, named_tokenizer_files


class Tokenizer(Protocol):
    name: str
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ModelTokenizer:
    """A model's own tokenizer: a SentencePiece model or a Hugging Face ``tokenizer.json``
    (``data_prep.dataset_tokenizer``), given as a file (a ``tokenizer.json`` reads the ``tokenizer_config.json``
    beside it for its special tokens) or as the bytes the trainer read from its dataset."""

    def __init__(self, source: str | Path | TokenizerFiles, name: str | None = None) -> None:
        if not isinstance(source, TokenizerFiles):
            path = Path(source)
            source, name = named_tokenizer_files(path.parent, path.name), name or str(path)
        codec = source.codec()
        self.name = name or source.name
        self.kind = source.kind
        self.eos_id = codec.eos_id
        self.bos_id = codec.bos_id
        self.vocab_size = codec.vocab_size
        self._codec = codec

    def encode(self, text: str) -> list[int]:
        return self._codec.encode(text)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; an id outside the tokenizer's vocabulary (a model's vocabulary may be larger, and an
        untrained one predicts any id) becomes U+FFFD, as in ``ByteTokenizer``, where SentencePiece would raise."""
        if all(0 <= i < self.vocab_size for i in ids):
            return self._codec.decode(ids)
        runs: list[list[int]] = [[]]  # the in-vocabulary runs, decoded whole so multi-piece characters survive
        for i in ids:
            if 0 <= i < self.vocab_size:
                runs[-1].append(i)
            else:
                runs.append([])
        return "\ufffd".join(self._codec.decode(run) for run in runs)


class ByteTokenizer:
    """id = UTF-8 byte value; decoding replaces ids >= 256 (never produced by ``encode``) with U+FFFD."""

    name = "bytes"
    eos_id = None
    bos_id = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return b"".join(bytes([i]) if 0 <= i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", "replace")


def load_tokenizer(checkpoint: str | Path, export: dict, vocab_size: int) -> ModelTokenizer | ByteTokenizer:
    """The tokenizer named by ``export["tokenizer"]`` (``tokenizer.model`` or ``tokenizer.json``), else bytes.

    Raises:
        FileNotFoundError: the export names a tokenizer file that is not there.
        ValueError: ``export.tokenizer`` is not a file name, the file is not a tokenizer of its kind, or its
            vocabulary does not fit the model's ``vocab_size``.
    """
    name = export.get("tokenizer")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{checkpoint}/config.json: export.tokenizer={name!r} must be a file name")
    if name:
        path = Path(checkpoint) / name if not Path(name).is_absolute() else Path(name)
        try:
            tok: ModelTokenizer | ByteTokenizer = ModelTokenizer(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{checkpoint}/config.json: export.tokenizer={name!r} but {path} does not exist"
            ) from None
        except (ValueError, OSError) as err:  # a FIFO or link in its place, an empty or foreign file: named
            raise ValueError(
                f"{path}: {str(err).splitlines()[0]}; copy the dataset's tokenizer files into the export again"
            ) from None
    else:
        tok = ByteTokenizer()
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}"
            + ("" if name else " (a model without export.tokenizer is fed UTF-8 bytes)")
        )
    return tok

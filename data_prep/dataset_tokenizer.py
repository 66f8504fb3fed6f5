"""Which tokenizer a dataset, an export or a dense model folder has, and text <-> ids with it: the one place that
knows both kinds, a SentencePiece ``tokenizer.model`` and a Hugging Face ``tokenizer.json`` (with its
``tokenizer_config.json``, which names the special tokens).

Everything that reads a tokenizer beside token ids goes through here: the trainer (vocab check, retrieval mix,
passkey probe, exports), the eval jobs and the dense-model check. Files are read as regular files only
(``data_prep.safe_files``): a dataset or export may come from someone else. Both kinds encode without adding
special tokens and decode without skipping any, as prep encoded the data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from data_prep.format import (
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_JSON,
    MANIFEST_FILENAME,
    TOKENIZER_FILENAME,
    TokenizerInfo,
)
from data_prep.json_file import DEFAULT_MAX_BYTES
from data_prep.safe_files import UnsafeDatasetError, read_followed, read_regular, stat_regular

__all__ = [
    "HF",
    "SENTENCEPIECE",
    "TextCodec",
    "TokenizerFiles",
    "folder_tokenizer",
    "manifest_mismatch",
    "named_tokenizer_files",
    "read_tokenizer_files",
]

SENTENCEPIECE = "sentencepiece"
HF = "hf"
_FILENAMES = {SENTENCEPIECE: TOKENIZER_FILENAME, HF: HF_TOKENIZER_JSON}


class TextCodec:
    """Text <-> ids of one tokenizer, with its vocabulary size and EOS / BOS ids (None when it has none)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]

    def __init__(self, files: TokenizerFiles) -> None:
        if files.kind == HF:
            from data_prep import hf_tokenizer

            tok = hf_tokenizer.parse_tokenizer(files.data, files.name)
            ids = hf_tokenizer.special_ids(tok, files.config)
            self.vocab_size = hf_tokenizer.vocab_size(tok)
            eos, bos = ids["eos_id"], ids["bos_id"]
            self.encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self.decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)
        else:
            import sentencepiece as spm

            try:
                sp = spm.SentencePieceProcessor(model_proto=files.data)
            except RuntimeError as err:  # sentencepiece's parse error is a bare RuntimeError
                raise ValueError(f"{files.name} is not a SentencePiece model ({str(err).splitlines()[0]})") from None
            self.vocab_size = sp.get_piece_size()
            if self.vocab_size == 0:  # empty bytes load as a model without pieces, which fails at the first encode
                raise ValueError(f"{files.name} is not a SentencePiece model ({len(files.data)} bytes, no pieces)")
            eos, bos = sp.eos_id(), sp.bos_id()
            self.encode = lambda text: sp.encode(text)
            self.decode = lambda ids: sp.decode(list(ids))
        self.eos_id = eos if eos >= 0 else None
        self.bos_id = bos if bos >= 0 else None


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer as the bytes of its files: ``kind`` `SENTENCEPIECE` (``data`` is ``tokenizer.model``) or `HF`
    (``data`` is ``tokenizer.json``, ``config`` its ``tokenizer_config.json`` or None)."""

    kind: str
    data: bytes
    config: bytes | None = None

    @property
    def name(self) -> str:
        """The file ``data`` is stored as."""
        return _FILENAMES[self.kind]

    @property
    def sha256(self) -> str:
        """sha256 of ``data``: the manifest's ``tokenizer.sha256`` and the data fingerprint's ``tokenizer_sha256``."""
        return hashlib.sha256(self.data).hexdigest()

    def files(self) -> dict[str, bytes]:
        """File name -> bytes, as a dataset or export stores them."""
        out = {self.name: self.data}
        if self.config is not None:
            out[HF_TOKENIZER_CONFIG] = self.config
        return out

    def codec(self) -> TextCodec:
        """Raises ValueError naming the file when it is not a tokenizer of its kind."""
        return TextCodec(self)


def read_tokenizer_files(root: Path) -> TokenizerFiles | None:
    """The tokenizer beside a dataset's splits: ``tokenizer.model`` or ``tokenizer.json`` (+ its config), read as
    regular files only; None when there is neither.

    Raises:
        UnsafeDatasetError: a tokenizer file is a link, FIFO, device or directory, or the directory holds both
            kinds (which one the ids come from would be a guess).
    """
    has_sp = stat_regular(root, TOKENIZER_FILENAME) is not None
    has_hf = stat_regular(root, HF_TOKENIZER_JSON) is not None
    if has_sp and has_hf:
        raise UnsafeDatasetError(
            f"{root} holds both {TOKENIZER_FILENAME} and {HF_TOKENIZER_JSON}: data prep writes one; remove the other"
        )
    if has_sp:
        return TokenizerFiles(SENTENCEPIECE, _read(root, TOKENIZER_FILENAME))
    if has_hf:
        config = _read(root, HF_TOKENIZER_CONFIG) if stat_regular(root, HF_TOKENIZER_CONFIG) else None
        return TokenizerFiles(HF, _read(root, HF_TOKENIZER_JSON), config)
    return None


def _read(directory: Path, name: str) -> bytes:
    """A tokenizer file as a regular file of at most ``DEFAULT_MAX_BYTES`` (the largest ``tokenizer.json`` of a
    released model is ~30 MB), never through a link."""
    return read_regular(directory, name, max_size=DEFAULT_MAX_BYTES)


def manifest_mismatch(root: Path, recorded: TokenizerInfo, found: TokenizerFiles | None) -> str | None:
    """Why ``found``, the tokenizer beside ``root``'s splits (`read_tokenizer_files`), is not the one ``root``'s
    manifest records (None when it is): of its kind, with its sha256 (and its config's, for `HF`). The token ids come
    from the recorded tokenizer; another one in its place (same vocabulary size or not) would be trained on silently
    and shipped with every export."""
    manifest = root / MANIFEST_FILENAME
    name = _FILENAMES.get(recorded.type, TOKENIZER_FILENAME)
    if found is None:
        return f"{root / name} is missing, but {manifest} records a {recorded.type} one (sha256 {recorded.sha256})"
    if found.kind != recorded.type:
        return (
            f"{root / found.name} is a {found.kind} tokenizer, but {manifest} records a {recorded.type} one ({name}, "
            f"sha256 {recorded.sha256})"
        )
    config = hashlib.sha256(found.config).hexdigest() if found.config is not None else ""
    for file, actual, expected in (
        (found.name, found.sha256, recorded.sha256),
        (HF_TOKENIZER_CONFIG, config, recorded.config_sha256 if found.kind == HF else ""),
    ):
        if actual != expected:
            return (
                f"{root / file} has sha256 {actual or '(no file)'}, but {manifest} records {expected or '(no file)'}: "
                "the tokenizer was replaced or changed after data prep (the token ids come from the recorded one)"
            )
    return None


def named_tokenizer_files(directory: Path, name: str) -> TokenizerFiles:
    """The tokenizer an export names (``export.tokenizer``): ``tokenizer.json`` is a Hugging Face one (with the
    ``tokenizer_config.json`` beside it, if any), any other name a SentencePiece model.

    Raises:
        FileNotFoundError: no such file. UnsafeDatasetError: it is not a regular file.
    """
    data = _read(directory, name)
    if name != HF_TOKENIZER_JSON:
        return TokenizerFiles(SENTENCEPIECE, data)
    try:
        config = _read(directory, HF_TOKENIZER_CONFIG)
    except FileNotFoundError:
        config = None
    return TokenizerFiles(HF, data, config)


def folder_tokenizer(directory: Path, kind: str | None = None) -> TokenizerFiles | None:
    """The tokenizer of a dense model folder (a ``transformers`` checkpoint, which the user names and the HF cache
    fills with links, so links are followed): of ``kind`` when given, else its ``tokenizer.model`` when it has one
    (Llama-2, Mistral: both files, the same tokenizer), else its ``tokenizer.json``; None when it has none.

    Raises:
        UnsafeDatasetError: a tokenizer file there is not a regular file (a FIFO would block the read) or cannot be
            read (one line naming it).
    """
    kinds = [kind] if kind is not None else [SENTENCEPIECE, HF]
    for candidate in kinds:
        data = read_followed(directory / _FILENAMES[candidate])
        if data is not None:
            extra = read_followed(directory / HF_TOKENIZER_CONFIG) if candidate == HF else None
            return TokenizerFiles(candidate, data, extra)
    return None

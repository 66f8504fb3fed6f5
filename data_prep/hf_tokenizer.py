"""A Hugging Face tokenizer (``tokenizer.json``) as prep's tokenizer: read offline, checked, described, and encoded
in segments only where that provably gives the whole document's ids.

``tokenizer.type=hf tokenizer.path=<dir>`` reads ``<dir>/tokenizer.json`` with the ``tokenizers`` library (no hub,
no ``transformers``) and ``<dir>/tokenizer_config.json`` when present, for the names of its special tokens. Text is
encoded with ``add_special_tokens=False``: a dataset holds plain token streams, and the trainer puts the EOS between
documents.

**Segments.** Prep encodes long documents in segments cut just before a space that follows a non-space
(``data_prep.tokenize.segments``). That equals one whole-document encode only for tokenizers whose pre-tokenizer
never joins a non-space and the following space into one piece and adds nothing at the start of an encode call:
`segment_safe` accepts the byte-level BPE layouts of GPT-2 (``ByteLevel`` with its own regex), Llama-3 and Qwen2
(their ``Split`` regex, then ``ByteLevel`` without a regex), no ``add_prefix_space``, no normalizer or NFC, and added
tokens without whitespace or strip flags. Every other tokenizer (a SentencePiece-style ``Metaspace`` /
``Prepend("▁")`` one, like Llama-2's, adds a ``▁`` to each call's text) encodes each document in one call. Safe
segments are also never cut hard in a run without spaces (CJK text, base64), which would split a pre-token.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from data_prep.errors import ConfigError
from data_prep.format import HF_TOKENIZER_CONFIG as TOKENIZER_CONFIG
from data_prep.format import HF_TOKENIZER_JSON as TOKENIZER_JSON
from data_prep.json_file import Fields, parse_json
from data_prep.safe_files import UnsafeDatasetError, read_followed

logger = logging.getLogger(__name__)

__all__ = [
    "TOKENIZER_CONFIG",
    "TOKENIZER_JSON",
    "HFEncoder",
    "describe",
    "HFTokenizerFiles",
    "is_tokenizer_json",
    "parse_tokenizer",
    "read_folder",
    "segment_safe",
    "special_ids",
    "vocab_size",
]

_SAFE_SPLIT_PATTERNS = {
    # Llama-3's pre-tokenizer regex, and Qwen2's (the same with single digits)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
    + digits
    + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    for digits in (r"\p{N}{1,3}", r"\p{N}")
}
"""Regexes under which no pre-token holds a non-space followed by a space (each alternative either stops at
whitespace or starts with it), so a cut before such a space is a pre-token boundary of the whole text; and no
lookahead reads past a segment that ends in a non-space. Checked with a test against whole-document encodes."""
_SAFE_NORMALIZERS = (None, "NFC")
"""Normalizers that act the same on both sides of a cut before a space: none, or NFC (a space composes with
nothing before it)."""
_SPECIAL_NAMES = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"),
    "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
}
"""Without a tokenizer_config.json: the special (added) tokens taken as BOS / EOS, first match wins."""


@dataclass(frozen=True)
class HFTokenizerFiles:
    """The bytes of a Hugging Face tokenizer folder that prep copies beside the splits."""

    tokenizer_json: bytes
    config: bytes | None
    """``tokenizer_config.json``, or None when the folder has none."""


def is_tokenizer_json(data: bytes) -> bool:
    """Whether ``data`` is a ``tokenizer.json`` (JSON text) rather than a serialized SentencePiece model: a
    ``ModelProto`` starts with a field tag, never with ``{`` (field 15, a group, does not exist in it)."""
    return data.lstrip()[:1] == b"{"


def parse_tokenizer(data: bytes, where: str) -> Tokenizer:
    """The tokenizer of ``tokenizer.json`` bytes.

    Raises:
        ValueError: not a tokenizer file the ``tokenizers`` library reads (one line naming ``where``).
    """
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file; also UnicodeDecodeError
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{where} is not a readable tokenizer.json ({first})") from None


def _config(data: bytes | None, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    config = parse_json(data, where)
    if not isinstance(config, dict):
        raise ValueError(f"{where} is not a JSON object")
    return config


def read_folder(path: str) -> tuple[HFTokenizerFiles, Tokenizer]:
    """Read and check ``tokenizer.path``: its ``tokenizer.json`` parses, its ``tokenizer_config.json`` (if any) is a
    JSON object naming tokens the tokenizer has, and its ids fit the dataset's uint32 token column.

    Raises:
        ConfigError: one line naming ``tokenizer.path`` and the file.
    """
    folder = Path(path)
    try:  # regular files only (links followed: an HF cache folder is links); a FIFO would block the read
        data = read_followed(folder / TOKENIZER_JSON)
        config = read_followed(folder / TOKENIZER_CONFIG)
    except UnsafeDatasetError as err:
        raise ConfigError(f"bad value tokenizer.path={path!r}: {err}") from None
    if data is None:
        raise ConfigError(f"bad value tokenizer.path={path!r}: cannot read {folder / TOKENIZER_JSON} (no such file)")
    files = HFTokenizerFiles(data, config)
    try:
        tokenizer = parse_tokenizer(data, str(folder / TOKENIZER_JSON))
        special_ids(tokenizer, config, str(folder / TOKENIZER_CONFIG))
    except ValueError as err:
        raise ConfigError(f"bad value tokenizer.path={path!r}: {err}") from None
    size = vocab_size(tokenizer)
    if size > 1 << 32:
        raise ConfigError(
            f"bad value tokenizer.path={path!r}: {folder / TOKENIZER_JSON} has ids up to {size - 1}, more than the "
            "dataset's uint32 token column holds"
        )
    return files, tokenizer


def vocab_size(tokenizer: Tokenizer) -> int:
    """One more than the largest id (added tokens included): what the model's embedding must hold."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def _token_name(value: Any) -> str | None:
    """A ``tokenizer_config.json`` token entry: a string, or an ``AddedToken`` object with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_ids(tokenizer: Tokenizer, config: bytes | None, where: str = TOKENIZER_CONFIG) -> dict[str, int]:
    """``unk_id``, ``bos_id``, ``eos_id``, ``pad_id`` (-1 when absent).

    With a ``tokenizer_config.json``, its ``<x>_token`` entries name them (``eos_token: <|endoftext|>`` for Qwen2);
    without one, or for a key it does not set, BOS / EOS are the first special added token named in `_SPECIAL_NAMES`
    and UNK the BPE / WordPiece / Unigram model's own; PAD only ever comes from the config.

    Raises:
        ValueError: the config is not a JSON object, or names a token the tokenizer does not have.
    """
    entries = _config(config, where)
    ids: dict[str, int] = {}
    for kind in ("unk", "bos", "eos", "pad"):
        name = _token_name(entries.get(f"{kind}_token"))
        if name is not None:
            found = tokenizer.token_to_id(name)
            if found is None:
                raise ValueError(f"{where}: {kind}_token={name!r} is not a token of tokenizer.json")
            ids[f"{kind}_id"] = found
        else:
            ids[f"{kind}_id"] = _default_id(tokenizer, kind)
    return ids


def _default_id(tokenizer: Tokenizer, kind: str) -> int:
    if kind == "unk":
        unk = getattr(tokenizer.model, "unk_token", None)
        if isinstance(unk, str):
            return tokenizer.token_to_id(unk) if tokenizer.token_to_id(unk) is not None else -1
        unk_id = getattr(tokenizer.model, "unk_id", None)  # Unigram keeps an id
        return unk_id if isinstance(unk_id, int) else -1
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for name in _SPECIAL_NAMES.get(kind, ()):
        if name in special:
            return tokenizer.token_to_id(name)
    return -1


def describe(files: HFTokenizerFiles, tokenizer: Tokenizer) -> dict[str, Any]:
    """The manifest's ``tokenizer`` fields for an HF tokenizer (``data_prep.format.TokenizerInfo``)."""
    model = Fields(parse_json(files.tokenizer_json, TOKENIZER_JSON), TOKENIZER_JSON).mapping("model")
    return {
        "type": "hf",
        "sha256": hashlib.sha256(files.tokenizer_json).hexdigest(),
        "config_sha256": hashlib.sha256(files.config).hexdigest() if files.config is not None else "",
        "vocab_size": vocab_size(tokenizer),
        "model_type": str(model.get("type", "unknown")).lower(),
        "trained": False,
        **special_ids(tokenizer, files.config),
    }


def segment_safe(tokenizer_json: dict[str, Any]) -> str | None:
    """None when segment-wise encoding equals whole-document encoding (see the module docstring), else why not."""
    normalizer = (tokenizer_json.get("normalizer") or {}).get("type")
    if normalizer not in _SAFE_NORMALIZERS:
        return f"normalizer {normalizer}"
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return f"model {model.get('type')}" + (" with dropout" if model.get("dropout") else "")
    for added in tokenizer_json.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in added.get("content", "")):
            return f"added token {added.get('content')!r} holds or strips whitespace"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and _byte_level(steps[0], use_regex=True):
        return None
    if (
        len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("pattern", {}).get("Regex") in _SAFE_SPLIT_PATTERNS
        and steps[0].get("behavior") == "Isolated"
        and not steps[0].get("invert")
        and _byte_level(steps[1], use_regex=False)
    ):
        return None
    return f"pre-tokenizer {[step.get('type') for step in steps]}"


def _byte_level(step: dict[str, Any], use_regex: bool) -> bool:
    return (
        step.get("type") == "ByteLevel"
        and not step.get("add_prefix_space")
        and bool(step.get("use_regex", True)) == use_regex
    )


class HFEncoder:
    """Prep's encoder for a ``tokenizer.json``: ``encode_batch`` into uint32 id arrays, which runs in Rust without
    the GIL (a plain ``encode`` holds it: measured, a Python thread stalls for the whole call). ``unsafe`` says why
    documents must not be cut into segments (None: they may; `segment_safe`)."""

    def __init__(self, data: bytes) -> None:
        self.tokenizer = parse_tokenizer(data, TOKENIZER_JSON)
        self.unsafe = segment_safe(parse_json(data, TOKENIZER_JSON))

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [
            np.asarray(encoding.ids, dtype=np.uint32)
            for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)
        ]

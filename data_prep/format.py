"""The on-disk contract between ``make prep`` and the trainer (``pipeline/data/reader.py``).

A prepared dataset is a directory::

    <output>/
      train/            MDS dataset (index.json + shard.NNNNN.mds.zstd)
      val/              MDS dataset, same columns
      tokenizer.model   the SentencePiece model the tokens come from, or
      tokenizer.json    a Hugging Face tokenizer (``tokenizer.type=hf``), with its tokenizer_config.json if it had one
      manifest.json     `Manifest` below, as JSON
      _COMPLETE         sha256 hex of manifest.json's bytes; written last, before the directory is renamed

One MDS sample is one piece of one document: the column `TOKENS` holds its token ids (no BOS/EOS added;
`Manifest.tokenizer.eos_id` tells the trainer what to put between documents), `DOC_ID` the document's
ordinal among the documents the readers yielded (unreadable records get none; empty ones use up theirs)
and `PIECE` the piece's index within the document. Consecutive pieces with one
`DOC_ID` concatenate to the whole document. Packing into sequences and landmark insertion happen in the
trainer, so the GCA chunk length can change without re-sharding.

The split holds out whole documents, or the tail of every document with the same `DOC_ID` in both splits
(`ValSplitInfo`, ``data_prep.split``): a document's train pieces and val pieces are disjoint parts of its text,
which concatenate to the whole. A split with no documents
(``val_fraction=0``, or a corpus of a single document) is not written at all: its directory is absent, and its
`SplitStats` in the manifest has ``documents``, ``pieces`` and ``tokens`` 0 and ``index_sha256`` ``""``
(`EMPTY_SPLIT_SHA256`). Every split directory that exists can be opened by ``StreamingDataset`` (which refuses an
index without samples); check `Manifest.has_split` before opening one.

These names are imported by the pipeline; keep them stable, and bump `FORMAT_VERSION` on any change that an
older reader would misread (a field added with a default, like `Manifest.val_split`, is not one: an older reader
ignores it and a manifest without it reads as the default).
"""

import hashlib
import json
import operator
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_prep.json_file import DEFAULT_MAX_BYTES, Fields, JsonFileError, parse_json
from data_prep.safe_files import CONFIG_KEYS, read_regular

__all__ = [
    "COMPLETE_MARKER",
    "DOC_ID",
    "EMPTY_SPLIT_SHA256",
    "FORMAT_VERSION",
    "HF_TOKENIZER_CONFIG",
    "HF_TOKENIZER_FILENAMES",
    "HF_TOKENIZER_JSON",
    "MANIFEST_FILENAME",
    "PIECE",
    "SPLITS",
    "TOKENIZER_FILENAME",
    "TOKENS",
    "IncompleteDatasetError",
    "InputFingerprint",
    "LengthHistogram",
    "Manifest",
    "SplitStats",
    "TokenizerInfo",
    "ValSplitInfo",
    "bucket_tokens",
    "document_in_bucket",
    "is_prep_temporary",
    "length_bin",
    "manifest_from_dict",
    "mds_columns",
    "read_manifest",
    "split_count_mismatch",
    "token_dtype_for_vocab",
]

FORMAT_VERSION = 1
TOKENS = "tokens"
DOC_ID = "doc_id"
PIECE = "piece"
SPLITS = ("train", "val")
MANIFEST_FILENAME = "manifest.json"
TOKENIZER_FILENAME = "tokenizer.model"
HF_TOKENIZER_JSON = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_TOKENIZER_FILENAMES = (HF_TOKENIZER_JSON, HF_TOKENIZER_CONFIG)
"""What a dataset prepared with ``tokenizer.type=hf`` holds in place of `TOKENIZER_FILENAME` (the config only when
the tokenizer's folder had one)."""
COMPLETE_MARKER = "_COMPLETE"
EMPTY_SPLIT_SHA256 = ""
"""`SplitStats.index_sha256` of a split with no documents, whose directory is not written."""

_UINT16_MAX_VOCAB = 1 << 16
_TOKEN_BYTES = {"uint16": 2, "uint32": 4}


class IncompleteDatasetError(RuntimeError):
    """The directory is not a completed prepared dataset (missing or mismatched `_COMPLETE` marker)."""


_PREP_TEMPORARY = re.compile(r"\..+\.(tmp|old)-\d+")


def is_prep_temporary(path: str | Path) -> bool:
    """Whether ``path`` is named like data prep's work directories (``.<output>.tmp-<pid>`` while writing,
    ``.<output>.old-<pid>`` while replacing): a leftover of an interrupted run, never a dataset to train on."""
    return _PREP_TEMPORARY.fullmatch(Path(path).name) is not None


def token_dtype_for_vocab(vocab_size: int) -> str:
    """The numpy dtype name of the `TOKENS` column: ``"uint16"`` when every id fits, else ``"uint32"``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= _UINT16_MAX_VOCAB else "uint32"


def mds_columns(token_dtype: str) -> dict[str, str]:
    """The MDS column encodings for a dataset whose tokens have numpy dtype ``token_dtype``."""
    if token_dtype not in ("uint16", "uint32"):
        raise ValueError(f"token_dtype must be 'uint16' or 'uint32', got {token_dtype!r}")
    return {TOKENS: f"ndarray:{token_dtype}", DOC_ID: "int", PIECE: "int"}


def length_bin(length: int) -> int:
    """The `LengthHistogram` bin of a document of ``length`` tokens: ``b`` with ``2**b <= length < 2**(b + 1)``.

    Raises:
        ValueError: ``length`` is below 1 (a written document has at least one token).
    """
    if length < 1:
        raise ValueError(f"a document's length must be at least 1 token, got {length}")
    return int(length).bit_length() - 1


@dataclass(frozen=True)
class LengthHistogram:
    """The documents of one split by their length, in power-of-two bins, so a reader can select and budget documents
    by length without opening a shard (`bucket_tokens`, `document_in_bucket`).

    A document's length is its token count in this split (no EOS): the sum of its pieces' `TOKENS` lengths. With
    ``val_split.unit`` ``tokens`` a document id is in both splits, and each split counts only its own part.
    """

    documents: list[int]
    """``documents[b]``: how many documents have ``2**b <= length < 2**(b + 1)``; prep writes no trailing empty bins
    (``[]`` for an empty split). Sums to `SplitStats.documents`."""
    tokens: list[int]
    """``tokens[b]``: the tokens of those documents, between ``documents[b] * 2**b`` and
    ``documents[b] * (2**(b + 1) - 1)``. As long as `documents`; sums to `SplitStats.tokens`."""
    spanning_documents: dict[str, int] = field(default_factory=dict)
    """Every document whose pieces lie in more than one shard file of the split (the writer cuts shards by size):
    its `DOC_ID` as a decimal string, to its whole length in this split. A reader that lays out one shard at a time
    learns such a document's full length from here. At most one per shard boundary."""

    def spanning_lengths(self) -> dict[int, int]:
        """`spanning_documents` keyed by the integer `DOC_ID` a reader decodes."""
        return {int(doc): length for doc, length in self.spanning_documents.items()}


def _bucket_bounds(min_tokens: int | None, max_tokens: int | None) -> tuple[int, int | None]:
    """(lower bound, upper bound or None) of a length bucket, each a power of two or 0/None for no bound."""
    bounds: list[int] = []
    for name, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        try:
            number = 0 if value is None else operator.index(value)
        except TypeError:
            number = -1
        if isinstance(value, bool) or number < 0 or number & (number - 1):
            raise ValueError(
                f"{name}={value!r} is not a power of two (or 0/None for no bound): the length histogram's bins are "
                "[2**b, 2**(b+1)) tokens, so a bucket can only start and end at a power of two"
            )
        bounds.append(number)
    low, high = bounds
    if high and low >= high:
        raise ValueError(f"min_tokens={min_tokens!r} must be below max_tokens={max_tokens!r}")
    return low, high or None


def bucket_tokens(hist: LengthHistogram, min_tokens: int | None, max_tokens: int | None) -> tuple[int, int]:
    """(documents, tokens) of the documents with ``min_tokens <= length < max_tokens``, from the histogram alone.

    The bucket is by whole-document length (see `document_in_bucket`): a document is in or out with all its pieces,
    also one that crosses a shard boundary (`LengthHistogram.spanning_documents`).

    Args:
        hist: a split's `SplitStats.length_histogram`.
        min_tokens: a power of two; 0 or None for no lower bound.
        max_tokens: a power of two above ``min_tokens``; 0 or None for no upper bound.

    Raises:
        ValueError: a bound that is not a power of two (naming it: the bins cannot split a range between two),
            or ``min_tokens >= max_tokens``.
    """
    low, high = _bucket_bounds(min_tokens, max_tokens)
    first = low.bit_length() - 1 if low else 0
    stop = high.bit_length() - 1 if high is not None else len(hist.documents)
    return sum(hist.documents[first:stop]), sum(hist.tokens[first:stop])


def document_in_bucket(length: int, min_tokens: int | None, max_tokens: int | None) -> bool:
    """Whether a document of ``length`` tokens is in the bucket ``[min_tokens, max_tokens)`` that `bucket_tokens`
    counts (the same bounds, refused the same way).

    ``length`` is the whole document's token count in the split: the sum of all its pieces, not one piece's and not
    the part in one shard. For a document in `LengthHistogram.spanning_documents`, a reader that sees one shard at
    a time takes the length from there; every other document lies in one shard, whole.
    """
    low, high = _bucket_bounds(min_tokens, max_tokens)
    return low <= length and (high is None or length < high)


@dataclass(frozen=True)
class SplitStats:
    """Counts for one split, equal to what a reader of ``<output>/<split>/`` gets (held against the split's index by
    `split_count_mismatch`)."""

    documents: int
    """Distinct documents (distinct `DOC_ID` values)."""
    pieces: int
    """MDS samples; more than `documents` when long documents were split."""
    tokens: int
    """Sum of the lengths of all `TOKENS` arrays."""
    index_sha256: str
    """sha256 of the split's index.json, which itself lists every shard's xxh64: a content fingerprint;
    `EMPTY_SPLIT_SHA256` for a split with no documents (no directory)."""
    length_histogram: LengthHistogram | None = None
    """Documents and tokens by document length, and the documents that cross a shard boundary; None in manifests
    written before prep recorded it (they read as before)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer the `TOKENS` ids come from (a copy is at ``<output>/tokenizer.model``, or ``tokenizer.json``
    for `type` ``hf``)."""

    sha256: str
    """sha256 of the serialized SentencePiece model (of ``tokenizer.json`` for `type` ``hf``)."""
    vocab_size: int
    model_type: str
    """SentencePiece model type, e.g. ``"bpe"`` or ``"unigram"``."""
    trained: bool
    """True if ``make prep`` trained it on a sample of this corpus, False if it was given."""
    unk_id: int
    bos_id: int
    """-1 when the model has no BOS piece."""
    eos_id: int
    """-1 when the model has no EOS piece."""
    pad_id: int
    """-1 when the model has no PAD piece."""
    type: str = "sentencepiece"
    """``sentencepiece`` (the ids come from ``tokenizer.model``) or ``hf`` (from a Hugging Face ``tokenizer.json``,
    copied as ``<output>/tokenizer.json`` with its ``tokenizer_config.json`` when it had one; ``sha256`` is the
    ``tokenizer.json``'s, `model_type` its model's, the special ids as ``data_prep.hf_tokenizer.special_ids`` chose
    them). Manifests written before HF tokenizers read as ``sentencepiece``."""
    config_sha256: str = ""
    """``hf``: sha256 of the copied ``tokenizer_config.json``; ``""`` when there is none (and for SentencePiece)."""


@dataclass(frozen=True)
class ValSplitInfo:
    """How the val split was drawn (``data_prep.split``)."""

    unit: str = "documents"
    """What was held out: ``documents`` (whole documents, each with all its pieces in one split) or ``tokens`` (the
    last ``val_fraction`` of every document, whose train part keeps the rest; a document id then appears in both
    splits). ``val_unit=auto`` chose it when the config says so; ``splits`` holds the token counts of each side."""
    lowest_hash_fallback: bool = False
    """True when no document hashed into ``val_fraction`` and the one with the lowest hash went to val instead."""


@dataclass(frozen=True)
class InputFingerprint:
    """Identity of one input, so a trainer or a rerun can tell whether the corpus changed."""

    path: str
    """A local path, or ``hf:<name>[/<config>]:<split>`` for a Hugging Face dataset."""
    size: int | None = None
    mtime_ns: int | None = None
    sha256: str | None = None
    """Content hash; set for the built-in corpus and when ``fingerprint=content``."""


@dataclass(frozen=True)
class Manifest:
    """Everything about how a prepared dataset was made. Serialized as ``<output>/manifest.json``."""

    format_version: int
    token_dtype: str
    """``"uint16"`` or ``"uint32"``; see `token_dtype_for_vocab`."""
    tokenizer: TokenizerInfo
    splits: dict[str, SplitStats]
    """Keyed by split name, one entry per name in `SPLITS`."""
    skipped: dict[str, int]
    """Documents left out, by reason (``empty``, ``non_utf8``, ``too_short``, ``malformed_json``, ...)."""
    inputs: list[InputFingerprint]
    config: dict[str, Any]
    """The resolved prep config (see ``data_prep.config.PrepConfig``)."""
    software: dict[str, str] = field(default_factory=dict)
    """Versions of python, sentencepiece and streaming used to write the dataset."""
    val_split: ValSplitInfo = field(default_factory=ValSplitInfo)
    """How documents were assigned to val; manifests written before it existed read as the plain hash rule."""

    def has_split(self, split: str) -> bool:
        """Whether ``<output>/<split>/`` exists and holds samples (an empty split is not written)."""
        return split in self.splits and self.splits[split].pieces > 0

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys), so identical runs write identical bytes."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


_MAX_COUNT = 2**63 - 1
"""Counts and sizes of a manifest: any int64 (what numpy sums them into); a larger one is not data prep's."""
_MAX_ID = 2**32
"""Token ids and vocabulary sizes fit the uint32 token column."""


def _optional_int(fields: Fields, key: str, low: int = 0) -> int | None:
    return None if fields.obj.get(key) is None else fields.integer(key, low=low, high=_MAX_COUNT)


def _optional_str(fields: Fields, key: str) -> str | None:
    return None if fields.obj.get(key) is None else fields.string(key)


_MAX_BINS = 64
"""Bins 0..63: every length below 2**63 (`_MAX_COUNT`)."""
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def _bins(fields: Fields, key: str) -> list[int]:
    """The list under ``key``: at most `_MAX_BINS` non-negative counts, each named ``key[i]`` in a message."""
    values = fields.sequence(key)
    if len(values) > _MAX_BINS:
        raise JsonFileError(
            f"{fields.where}: field '{fields.prefix}{key}' has {len(values)} bins, at most {_MAX_BINS} "
            "(every length is below 2**63)"
        )
    entries = Fields({f"{key}[{i}]": value for i, value in enumerate(values)}, fields.where, fields.prefix)
    return [entries.integer(f"{key}[{i}]", low=0, high=_MAX_COUNT) for i in range(len(values))]


def _length_histogram(fields: Fields, documents: int, tokens: int) -> LengthHistogram:
    """A split's `LengthHistogram`, held to the split's counts and to its own bins; any mismatch is one line naming
    the field."""
    where, prefix = fields.where, fields.prefix
    counts = {key: _bins(fields, key) for key in ("documents", "tokens")}
    docs, toks = counts["documents"], counts["tokens"]
    if len(docs) != len(toks):
        raise JsonFileError(
            f"{where}: field '{prefix}tokens' has {len(toks)} bins but '{prefix}documents' has {len(docs)}"
        )
    split = prefix.removesuffix("length_histogram.")
    for key, bins, total in (("documents", docs, documents), ("tokens", toks, tokens)):
        if sum(bins) != total:
            raise JsonFileError(f"{where}: field '{prefix}{key}' sums to {sum(bins)}, but '{split}{key}' is {total}")
    for b, (n, t) in enumerate(zip(docs, toks, strict=True)):
        if not n * 2**b <= t <= n * (2 ** (b + 1) - 1):
            raise JsonFileError(
                f"{where}: field '{prefix}tokens[{b}]' is {t}, but {n} documents of 2**{b} to 2**{b + 1}-1 tokens "
                f"hold {n * 2**b} to {n * (2 ** (b + 1) - 1)}"
            )
    spanning = fields.mapping("spanning_documents")
    lengths = Fields(spanning, where, f"{prefix}spanning_documents.")
    for key in spanning:
        if not _DECIMAL.fullmatch(key) or int(key) > _MAX_COUNT:
            raise JsonFileError(
                f"{where}: field '{prefix}spanning_documents' has the key {_shown_key(key)}, expected a document id "
                "as a decimal integer"
            )
    found = {key: lengths.integer(key, low=2, high=tokens) for key in spanning}
    if len(found) > documents:
        raise JsonFileError(
            f"{where}: field '{prefix}spanning_documents' names {len(found)} documents, but '{split}documents' is "
            f"{documents}"
        )
    return LengthHistogram(documents=docs, tokens=toks, spanning_documents=found)


def _shown_key(key: str) -> str:
    text = json.dumps(key)
    return text if len(text) <= 60 else text[:57] + "..."


def manifest_from_dict(obj: Any, where: str = MANIFEST_FILENAME) -> Manifest:
    """Build a `Manifest` from its JSON object, each field taken with its type and range checked
    (``data_prep.json_file.Fields``), rejecting other format versions.

    Raises:
        ValueError: another format version, or a field of another type or out of range (a ``JsonFileError``
            naming ``where`` and the field).
    """
    fields = Fields(obj, where)
    version = obj.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"manifest format_version={version!r} is not supported (this code reads {FORMAT_VERSION}); re-run make prep"
        )
    tok = fields.nested("tokenizer")
    tokenizer = TokenizerInfo(
        sha256=tok.string("sha256"),
        vocab_size=tok.integer("vocab_size", low=1, high=_MAX_ID),
        model_type=tok.string("model_type"),
        trained=tok.boolean("trained"),
        **{key: tok.integer(key, low=-1, high=_MAX_ID) for key in ("unk_id", "bos_id", "eos_id", "pad_id")},
        type=tok.string("type", default="sentencepiece", choices=("sentencepiece", "hf")),
        config_sha256=tok.string("config_sha256", default=""),
    )
    splits = {}
    for name in fields.mapping("splits"):
        split = fields.nested("splits").nested(name)
        counts = {key: split.integer(key, low=0, high=_MAX_COUNT) for key in ("documents", "pieces", "tokens")}
        histogram = None
        if split.obj.get("length_histogram") is not None:
            histogram = _length_histogram(split.nested("length_histogram"), counts["documents"], counts["tokens"])
        splits[name] = SplitStats(**counts, index_sha256=split.string("index_sha256"), length_histogram=histogram)
    skipped = fields.nested("skipped")
    inputs = []
    for i in range(len(fields.sequence("inputs"))):
        entry = Fields(obj["inputs"][i], where, f"inputs[{i}].")
        inputs.append(
            InputFingerprint(
                path=entry.string("path"),
                size=_optional_int(entry, "size"),
                mtime_ns=_optional_int(entry, "mtime_ns", low=-_MAX_COUNT - 1),  # a file from before 1970
                sha256=_optional_str(entry, "sha256"),
            )
        )
    software = fields.nested("software") if "software" in obj else None
    val_split = fields.nested("val_split") if "val_split" in obj else None
    return Manifest(
        format_version=version,
        token_dtype=fields.string("token_dtype", choices=tuple(_TOKEN_BYTES)),
        tokenizer=tokenizer,
        splits=splits,
        skipped={key: skipped.integer(key, low=0, high=_MAX_COUNT) for key in skipped.obj},
        inputs=inputs,
        config=dict(fields.mapping("config")),
        software={key: software.string(key) for key in software.obj} if software is not None else {},
        val_split=ValSplitInfo(
            unit=val_split.string("unit", default="documents", choices=("documents", "tokens")),
            lowest_hash_fallback=val_split.boolean("lowest_hash_fallback", default=False),
        )
        if val_split is not None
        else ValSplitInfo(),
    )


def read_manifest(path: str | Path) -> Manifest:
    """Read and validate the manifest of a prepared dataset.

    Both files are read with `data_prep.safe_files.read_regular`: a dataset may come from someone else, and a
    ``manifest.json`` that is a symbolic link (to any file of the reader) or a FIFO (a read that never returns) is
    refused, naming the file, before anything is read from it.

    Args:
        path: the dataset directory (the ``output`` of ``make prep``).

    Returns:
        The parsed `Manifest`.

    Raises:
        IncompleteDatasetError: the directory has no `COMPLETE_MARKER`, or the marker's hash does not match
            manifest.json (an interrupted or tampered-with run).
        UnsafeDatasetError: manifest.json or the marker is a symbolic link, FIFO, device or directory.
        ValueError: the manifest has an unsupported format version or is not JSON.
    """
    root = Path(path)
    try:
        data = read_regular(root, MANIFEST_FILENAME, max_size=DEFAULT_MAX_BYTES)
        expected = read_regular(root, COMPLETE_MARKER, max_size=4096).decode("ascii", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        raise IncompleteDatasetError(
            f"{root} is not a completed prepared dataset (no {COMPLETE_MARKER} or {MANIFEST_FILENAME}); "
            "run make prep / launch/prep.py to (re)create it"
        ) from None
    manifest_path = root / MANIFEST_FILENAME
    actual = hashlib.sha256(data).hexdigest()
    if expected != actual:
        raise IncompleteDatasetError(
            f"{manifest_path} does not match {root / COMPLETE_MARKER} (sha256 {actual} != {expected[:64]}); "
            "the dataset was modified after it was written; re-run prep"
        )
    try:  # nesting bounded before the parse, each field checked: a resealed edit is one line naming the field
        return manifest_from_dict(parse_json(data, str(manifest_path)), str(manifest_path))
    except JsonFileError as err:
        raise ValueError(f"{err}; re-run prep") from None


# An MDS shard file (streaming's MDSWriter) is: the sample count (uint32), count + 1 offsets (uint32), the writer's
# config as JSON, then the samples. A sample of prep's columns is: the byte size of its one variable column (uint32),
# `DOC_ID` and `PIECE` (int64 each), and `TOKENS` as an NDArray of static dtype and dynamic shape: one byte of
# rank and shape dtype, the length in 1, 2 or 4 bytes (the smallest unsigned type that holds it), then the ids.
_SAMPLE_FIXED_BYTES = 4 + 8 + 8 + 1
_LENGTH_BYTES_MIN, _LENGTH_BYTES_MAX = 1, 4
"""Fewest and most bytes the length of one `TOKENS` array takes (a piece is shorter than 2**32 tokens)."""


def index_token_dtype(shard: dict[str, Any]) -> str | None:
    """The token dtype (``uint16``/``uint32``) of a checked index entry whose columns are prep's (`mds_columns`);
    None for another layout."""
    columns = dict(zip(shard["column_names"], shard["column_encodings"], strict=True))
    return next((dtype for dtype in _TOKEN_BYTES if columns == mds_columns(dtype)), None)


def _layout(shard: dict[str, Any], known: dict[str, tuple[str | None, int]]) -> tuple[str | None, int]:
    """The token dtype of a checked index entry laid out as prep writes its shards (`mds_columns`; None for another
    layout: the token count is derived from prep's layout only), and the bytes of the writer's config, which the
    shard file repeats as JSON. Remembered in ``known`` by the config's ``repr``: the shards of one dataset share
    one config, and an index may list 100,000 of them."""
    key = repr([shard[name] for name in CONFIG_KEYS])
    if key not in known:
        dtype = index_token_dtype(shard)
        config = json.dumps({name: shard[name] for name in CONFIG_KEYS}, sort_keys=True)
        known[key] = dtype, len(config.encode())
    return known[key]


def _token_range(shard: dict[str, Any], dtype: str, config_bytes: int) -> tuple[int, int]:
    """Fewest and most tokens a shard of prep's layout holds, from the sizes its index entry records: only the
    bytes each piece spends on its length are unknown (1, 2 or 4 of them, by the length), so the range spans
    3 / itemsize tokens per piece. Every piece holds at least one token (MDS refuses an empty array)."""
    samples = int(shard["samples"])
    payload = shard["raw_data"]["bytes"] - 4 * (samples + 2) - config_bytes - samples * _SAMPLE_FIXED_BYTES
    item = _TOKEN_BYTES[dtype]
    low = -(-(payload - samples * _LENGTH_BYTES_MAX) // item)  # rounded up
    return max(low, samples), (payload - samples * _LENGTH_BYTES_MIN) // item


def split_count_mismatch(root: Path, split: str, manifest: Manifest, shards: list[dict[str, Any]]) -> str | None:
    """Why the counts ``root``'s manifest records for ``split`` are not those of the split whose checked
    ``index.json`` lists ``shards`` (``[]`` for a split prep did not write); None when they agree.

    The manifest is sealed by `COMPLETE_MARKER`, but resealing an edited one is one sha256 away, and every figure
    derived from its counts (epochs, tokens available) would be wrong. So the counts are held against the index,
    which the reader reads anyway and whose hash `SplitStats.index_sha256` already pins:

    - ``pieces``: exactly the index's sample count;
    - ``token_dtype``: the index's `TOKENS` encoding;
    - ``tokens``: within the range the shard sizes allow (`_token_range`; exact up to 1.5 tokens per piece for
      uint16 ids), without opening a shard (the reader holds every shard to those sizes as it loads it);
    - ``documents``: consistent only (a document is one or more pieces): the index holds no document ids.
    """
    stats = manifest.splits[split]
    recorded = f"{root / MANIFEST_FILENAME} records"
    index = root / split / "index.json"
    samples = sum(int(shard["samples"]) for shard in shards)
    if stats.pieces != samples:
        return f"{recorded} splits.{split}.pieces={stats.pieces}, but {index} lists {samples} samples"
    known: dict[str, tuple[str | None, int]] = {}
    layouts = [_layout(shard, known) for shard in shards]
    if any(dtype != manifest.token_dtype for dtype, _ in layouts):
        found = sorted({dtype or "another layout than data prep writes" for dtype, _ in layouts})
        return f"{recorded} token_dtype={manifest.token_dtype}, but {index} lists shards of {', '.join(found)}"
    ranges = [_token_range(shard, manifest.token_dtype, size) for shard, (_, size) in zip(shards, layouts, strict=True)]
    low, high = sum(r[0] for r in ranges), sum(r[1] for r in ranges)
    if not low <= stats.tokens <= high:
        return (
            f"{recorded} splits.{split}.tokens={stats.tokens}, but the {len(shards)} shards {index} lists hold "
            f"{low} to {high} tokens (by their sizes)"
        )
    if not min(samples, 1) <= stats.documents <= samples:
        return (
            f"{recorded} splits.{split}.documents={stats.documents}, but {index} lists {samples} samples (a document "
            "is one or more of them)"
        )
    return None

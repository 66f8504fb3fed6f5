"""Input corpora as streams of documents: local txt / jsonl / parquet files (optionally .gz / .zst),
Hugging Face datasets (``hf:<name>``) and the built-in offline corpus (``builtin:<name>``).

A ``.txt`` file is one document, a jsonl line or a parquet row is one document. Records that cannot be
used (malformed JSON, a missing or non-string text field, bytes that are not UTF-8) are skipped, counted
by reason in `SkipCounter`, and warned about with ``file:line``; with ``strict`` they raise `InputError`.
"""

import abc
import fnmatch
import glob
import gzip
import hashlib
import io
import json
import logging
import re
import stat
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from data_prep import builtin
from data_prep.config import PrepConfig
from data_prep.errors import InputError
from data_prep.format import InputFingerprint
from data_prep.redaction import redact
from data_prep.safe_files import file_kind

logger = logging.getLogger(__name__)

__all__ = ["Document", "FileSource", "HFSource", "SkipCounter", "Source", "iter_documents", "resolve_sources"]

HF_PREFIX = "hf:"
_COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
_FORMATS_BY_SUFFIX = {
    ".txt": "txt",
    ".text": "txt",
    ".md": "txt",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
_EXPECTED_REASONS = ("empty", "too_short")  # normal in any corpus: counted, not warned about, fine under strict
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""JSON's ``\\uXXXX`` escapes can name half of a surrogate pair alone: valid JSON, but text UTF-8 cannot encode."""
_TEXT_ENCODING = "utf-8-sig"
"""UTF-8 without a leading byte-order mark: editors on Windows start files with one, and it is no text (in a .jsonl
line it is not JSON, in a .txt it would become tokens of U+FEFF)."""
_WARNINGS_PER_REASON = 20  # beyond this, a reason's warnings are only counted, so a bad file cannot flood the log


@dataclass(frozen=True)
class Document:
    """One input document; `where` (``path`` or ``path:line``) is for messages only."""

    where: str
    text: str


class SkipCounter:
    """Counts skipped records by reason; logs the first few of each with their location, or raises if strict."""

    def __init__(self, strict: bool, quiet: bool = False) -> None:
        self.strict = strict
        self.quiet = quiet
        self.counts: Counter[str] = Counter()

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        """Record one skipped record (or raise `InputError` under strict for reasons that are input errors)."""
        message = f"{where}: {reason.replace('_', ' ')}{': ' + detail if detail else ''}"
        if self.strict and reason not in _EXPECTED_REASONS:
            raise InputError(f"{message} (strict=true; set strict=false to skip and count such records)")
        self.counts[reason] += 1
        if self.quiet:
            return
        if reason in _EXPECTED_REASONS:
            logger.debug("skipping %s", message)
        elif self.counts[reason] <= _WARNINGS_PER_REASON:
            logger.warning("skipping %s", message)
            if self.counts[reason] == _WARNINGS_PER_REASON:
                logger.warning("further '%s' skips are counted but not logged", reason)


class Source(abc.ABC):
    """A named input that yields documents and describes itself for the manifest."""

    name: str

    @abc.abstractmethod
    def documents(self, skips: SkipCounter) -> Iterator[Document]:
        """The documents in input order; bad records go to ``skips``."""

    @abc.abstractmethod
    def fingerprint(self, content: bool) -> InputFingerprint:
        """Identity for the manifest; ``content`` asks for a sha256 of the data where that is possible.

        Its path is redacted (`data_prep.redaction.redact`): a path or dataset name taken from the environment is
        written as its ``${oc.env:NAME}`` text, and a token inside one never reaches the manifest.
        """

    def size_bytes(self) -> int | None:
        """Approximate input size (for sampling rates); None when unknown."""
        return None


def _open_binary(path: Path) -> BinaryIO:
    kind = _COMPRESSED.get(path.suffix)
    if kind == "gzip":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if kind == "zstd":
        import pyarrow as pa  # pyarrow ships a streaming zstd decoder; the `zstd` package only does whole buffers

        stream = pa.input_stream(str(path), compression="zstd")
        return io.BufferedReader(stream, buffer_size=1 << 20)
    return open(path, "rb")


def _detect_format(path: Path, fmt: str) -> str | None:
    if fmt != "auto":
        return fmt
    suffix = Path(path.stem).suffix if path.suffix in _COMPRESSED else path.suffix
    return _FORMATS_BY_SUFFIX.get(suffix.lower())


class FileSource(Source):
    """One local file in one of the formats ``txt``, ``jsonl`` or ``parquet``."""

    def __init__(self, path: Path, fmt: str, text_field: str, label: str | None = None) -> None:
        self.path = path
        self.fmt = fmt
        self.text_field = text_field
        self.name = label or str(path)

    def size_bytes(self) -> int | None:
        return self.path.stat().st_size

    def fingerprint(self, content: bool) -> InputFingerprint:
        stat = self.path.stat()
        digest = None
        if content:
            with open(self.path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        return InputFingerprint(
            path=redact(str(self.path)), size=stat.st_size, mtime_ns=stat.st_mtime_ns, sha256=digest
        )

    def documents(self, skips: SkipCounter) -> Iterator[Document]:
        try:
            if self.fmt == "txt":
                yield from self._txt(skips)
            elif self.fmt == "jsonl":
                yield from self._jsonl(skips)
            else:
                yield from self._parquet(skips)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise InputError(f"{self.name}: cannot read ({type(exc).__name__}: {exc})") from None

    def _txt(self, skips: SkipCounter) -> Iterator[Document]:
        with _open_binary(self.path) as f:
            data = f.read()
        try:
            yield Document(self.name, data.decode(_TEXT_ENCODING))
        except UnicodeDecodeError as exc:
            skips.skip("non_utf8", self.name, f"invalid byte at offset {exc.start}")

    def _jsonl(self, skips: SkipCounter) -> Iterator[Document]:
        with _open_binary(self.path) as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{self.name}:{lineno}"
                if not raw.strip():
                    continue  # blank lines (a trailing newline, say) are not records
                try:
                    line = raw.decode(_TEXT_ENCODING)  # each line: files concatenated with `cat` keep their marks
                except UnicodeDecodeError as exc:
                    skips.skip("non_utf8", where, f"invalid byte at column {exc.start}")
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    skips.skip("malformed_json", where, exc.msg)
                    continue
                if not isinstance(record, dict):
                    skips.skip("malformed_json", where, f"expected an object, got {type(record).__name__}")
                    continue
                if self.text_field not in record:
                    skips.skip("missing_field", where, f"no field '{self.text_field}' (set text_field=...)")
                    continue
                text = record[self.text_field]
                if not isinstance(text, str):
                    skips.skip("bad_field_type", where, f"field '{self.text_field}' is {type(text).__name__}")
                    continue
                lone = _LONE_SURROGATE.search(text) if b"\\u" in raw else None  # only an escape can write one
                if lone:
                    skips.skip(
                        "non_utf8", where, f"lone surrogate escape \\u{ord(lone.group()):04x} (not encodable as UTF-8)"
                    )
                    continue
                yield Document(where, text)

    def _parquet(self, skips: SkipCounter) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.path.suffix in _COMPRESSED:
            raise InputError(f"{self.name}: parquet compresses internally; decompress the file first")
        try:
            pf = pq.ParquetFile(self.path)
        except pa.ArrowException as exc:
            raise InputError(f"{self.name}: not a readable parquet file ({exc})") from None
        schema = pf.schema_arrow
        if self.text_field not in schema.names:
            raise InputError(
                f"{self.name}: no column '{self.text_field}' (columns: {', '.join(schema.names)}); set text_field=..."
            )
        column_type = schema.field(self.text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise InputError(f"{self.name}: column '{self.text_field}' has type {column_type}, expected string")
        row = 0
        for batch in pf.iter_batches(columns=[self.text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    skips.skip("missing_field", f"{self.name}:row{row}", f"'{self.text_field}' is null")
                    continue
                yield Document(f"{self.name}:row{row}", text)


class NotRegularFile(FileSource):
    """A FIFO, device or socket found in an input folder or glob. Never opened (a FIFO read blocks until a writer
    comes, a device read may never end), yet not dropped unnoticed either: reading it counts one
    ``not_a_regular_file`` skip, named with what it is (so ``strict=true`` refuses it)."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(path, fmt="none", text_field="")
        self.kind = kind

    def size_bytes(self) -> int | None:
        return 0

    def fingerprint(self, content: bool) -> InputFingerprint:
        return InputFingerprint(path=redact(str(self.path)))  # its stat or content says nothing about data

    def documents(self, skips: SkipCounter) -> Iterator[Document]:
        skips.skip("not_a_regular_file", self.name, self.kind)
        yield from ()


def _not_regular_kind(path: Path) -> str | None:
    """What ``path`` is when it exists (links followed) but is neither a regular file nor a directory."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else file_kind(mode)


class HFSource(Source):
    """A dataset read with the ``datasets`` library (``hf:<name>``; see `data_prep.config.HFConfig`): a
    ``save_to_disk`` folder with ``datasets.load_from_disk``, anything else with ``datasets.load_dataset`` (a hub
    name, a packaged builder such as ``json``/``parquet``/``arrow`` over ``hf.data_files``, or a local directory).

    Sliced for a prep job array (`sliced`): slice ``i`` of ``n`` reads the ``i``-th of ``n`` contiguous runs of
    the dataset's files (``IterableDataset.shard``; rows for a ``save_to_disk`` folder), so the slices concatenated
    hold the documents in the order one unsliced run reads them.
    """

    def __init__(self, dataset: str, cfg: PrepConfig, num_slices: int = 1, slice_index: int = 0) -> None:
        self.dataset = dataset
        self.cfg = cfg
        self.hf = cfg.hf
        self.text_field = cfg.text_field
        self.num_slices, self.slice_index = num_slices, slice_index
        config = f"/{cfg.hf.config_name}" if cfg.hf.config_name else ""
        files = f"[{','.join(cfg.hf.data_files)}]" if cfg.hf.data_files else ""
        data_dir = f"/{cfg.hf.data_dir}" if cfg.hf.data_dir else ""
        self.name = f"{HF_PREFIX}{dataset}{config}{data_dir}{files}:{cfg.hf.split}"

    def sliced(self, num_slices: int, slice_index: int) -> "HFSource":
        """This dataset's part ``slice_index`` of ``num_slices`` (see the class docstring)."""
        return HFSource(self.dataset, self.cfg, num_slices, slice_index)

    def fingerprint(self, content: bool) -> InputFingerprint:
        # A hub dataset is pinned by its revision; content hashing would mean downloading it twice.
        revision = f"@{self.hf.revision}" if self.hf.revision else ""
        part = f" (slice {self.slice_index} of {self.num_slices})" if self.num_slices > 1 else ""
        return InputFingerprint(path=redact(self.name + revision + part))

    def _is_saved_dataset(self) -> bool:
        path = Path(self.dataset)
        return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))

    def _open(self) -> Any:
        import datasets

        if self._is_saved_dataset():
            ds = datasets.load_from_disk(self.dataset)
            if isinstance(ds, datasets.DatasetDict):
                if self.hf.split not in ds:
                    raise InputError(f"{self.name}: no split '{self.hf.split}' (splits: {', '.join(ds)}); set hf.split")
                ds = ds[self.hf.split]
            if self.num_slices > 1:
                ds = ds.shard(self.num_slices, self.slice_index, contiguous=True)
            return ds.to_iterable_dataset() if self.hf.streaming else ds
        ds = datasets.load_dataset(
            self.dataset,
            self.hf.config_name,
            data_files=list(self.hf.data_files) or None,
            data_dir=self.hf.data_dir,
            split=self.hf.split,
            revision=self.hf.revision,
            streaming=self.hf.streaming,
        )
        if self.num_slices > 1:
            if self.hf.streaming and ds.num_shards < self.num_slices:
                raise InputError(
                    f"{self.name}: num_slices={self.num_slices} is more than the dataset's {ds.num_shards} files; "
                    f"use at most {ds.num_shards} slices (or hf.streaming=false to slice by rows)"
                )
            ds = ds.shard(self.num_slices, self.slice_index, contiguous=True)
        return ds

    def documents(self, skips: SkipCounter) -> Iterator[Document]:
        try:
            ds = self._open()
        except InputError:
            raise
        except Exception as exc:  # network, auth, not-found and refused-script errors all have their own types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise InputError(f"{self.name}: cannot load dataset ({type(exc).__name__}: {first})") from None
        for i, record in enumerate(ds):
            where = f"{self.name}:{i}"
            if self.text_field not in record:
                raise InputError(
                    f"{where}: no field '{self.text_field}' (fields: {', '.join(record)}); set text_field=..."
                )
            text = record[self.text_field]
            if not isinstance(text, str):
                skips.skip("bad_field_type", where, f"field '{self.text_field}' is {type(text).__name__}")
                continue
            yield Document(where, text)


class ExcludeFilter:
    """`PrepConfig.exclude`: shell-style patterns matched against each input file's name relative to its input
    (the built-in corpus root or the input directory; a glob match or a named file as written). ``*`` matches
    across ``/``, so ``email/*`` leaves out a whole package. Counts the files each pattern removed, so a pattern
    that matches nothing (a typo) is reported instead of silently training on what it was meant to hold out."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = list(patterns)
        self.hits: Counter[str] = Counter()

    def keeps(self, name: str) -> bool:
        for pattern in self.patterns:
            if fnmatch.fnmatchcase(name, pattern):
                self.hits[pattern] += 1
                return False
        return True

    def check_all_used(self) -> None:
        unused = [p for p in self.patterns if not self.hits[p]]
        if unused:
            raise InputError(
                f"exclude={self.patterns}: {unused} matched no input file (patterns match the path relative to "
                "the input directory or built-in corpus root, e.g. 'email/*')"
            )
        if self.patterns:
            logger.info("exclude: left out %d input file(s)", sum(self.hits.values()))


class BuiltinSource(Source):
    """A built-in corpus (see `data_prep.builtin`): many txt files fingerprinted as one input."""

    def __init__(self, corpus: str, excluded: ExcludeFilter) -> None:
        self.name = f"{builtin.BUILTIN_PREFIX}{corpus}"
        self.root, files = builtin.labelled_corpus_files(corpus)
        self.files = [FileSource(p, "txt", "text", label=label) for label, p in files if excluded.keeps(label)]
        if not self.files:
            raise InputError(f"input '{self.name}': every file is excluded by exclude={excluded.patterns}")

    def size_bytes(self) -> int | None:
        return sum(f.path.stat().st_size for f in self.files)

    def fingerprint(self, content: bool) -> InputFingerprint:
        # Always by content: the corpus changes with the Python patch release, while mtimes change on reinstall.
        digest = hashlib.sha256()
        for f in self.files:
            digest.update(f.name.encode() + b"\0" + f.path.read_bytes() + b"\0")
        return InputFingerprint(
            path=redact(f"{self.name} ({self.root}, {len(self.files)} files)"),
            size=self.size_bytes(),
            sha256=digest.hexdigest(),
        )

    def documents(self, skips: SkipCounter) -> Iterator[Document]:
        for f in self.files:
            yield from f.documents(skips)


def _expand(entry: str, cfg: PrepConfig, excluded: ExcludeFilter) -> list[Source]:
    if entry.startswith(builtin.BUILTIN_PREFIX):
        return [BuiltinSource(entry.removeprefix(builtin.BUILTIN_PREFIX), excluded)]
    if entry.startswith(HF_PREFIX):
        return [HFSource(entry.removeprefix(HF_PREFIX), cfg)]
    path = Path(entry)
    if any(ch in entry for ch in "*?["):
        found = [Path(p) for p in sorted(glob.glob(entry, recursive=True))]
        paths = [p for p in found if (p.is_file() or _not_regular_kind(p)) and excluded.keeps(p.as_posix())]
        explicit = False
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if not p.name.startswith("."))
        paths = [p for p in found if p.is_file() or _not_regular_kind(p)]
        paths = [p for p in paths if excluded.keeps(p.relative_to(path).as_posix())]
        explicit = False
    elif path.is_file():
        paths, explicit = ([path] if excluded.keeps(path.as_posix()) else []), True
    elif kind := _not_regular_kind(path):
        raise InputError(
            f"input '{entry}' is {kind}, not a regular file; prep reads regular files only (write the data to a file "
            "and name that)"
        )
    else:
        raise InputError(f"input '{entry}' does not exist")
    if not paths and excluded.patterns:
        raise InputError(f"input '{entry}': every file is excluded by exclude={excluded.patterns}")
    sources: list[Source] = []
    for p in paths:
        if kind := _not_regular_kind(p):
            sources.append(NotRegularFile(p, kind))  # counted whatever its name: it may be meant as data
            continue
        fmt = _detect_format(p, cfg.format)
        if fmt is None:
            if explicit:
                raise InputError(f"input '{p}': unknown format (extension '{p.suffix}'); set format=txt|jsonl|parquet")
            continue  # a directory or glob may hold other files (READMEs, licenses); only known formats are read
        sources.append(FileSource(p, fmt, cfg.text_field))
    if not sources:
        raise InputError(f"input '{entry}' matched no .txt/.jsonl/.parquet files (optionally .gz/.zst)")
    return sources


def resolve_sources(cfg: PrepConfig) -> list[Source]:
    """Expand `PrepConfig.input` into sources, in a deterministic order (each glob / directory sorted).

    Raises:
        InputError: an entry does not exist, matches no readable files (or only excluded ones), or names an unknown
            built-in corpus; an ``exclude`` pattern matches no file.
    """
    excluded = ExcludeFilter(cfg.exclude)
    sources: list[Source] = []
    for entry in cfg.input:
        sources.extend(_expand(entry, cfg, excluded))
    excluded.check_all_used()
    return sources


def iter_documents(sources: list[Source], skips: SkipCounter) -> Iterator[Document]:
    """All documents of all sources, in order."""
    for source in sources:
        yield from source.documents(skips)

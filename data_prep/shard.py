"""``make prep``: documents -> SentencePiece ids -> ``train/`` and ``val/`` MDS datasets, written atomically.

`main` writes everything into a hidden temporary sibling of the output (``.<name>.tmp-<pid>``), writes
manifest.json and then the `_COMPLETE` marker holding the manifest's sha256, and only then renames the
directory into place. A crash at any point leaves either no output or the previous complete one; the
trainer's `data_prep.format.read_manifest` refuses anything without a matching marker.

Prep deletes only what it provably wrote: an existing output is replaced (``overwrite=true``) only when it is a
complete dataset holding nothing but the files its manifest and split indexes account for, and a leftover work
directory of a dead run only when it carries the marker every work directory gets when it is created. Everything
else is refused before any work, naming the path.
"""

import errno
import hashlib
import importlib
import json
import logging
import os
import platform
import shutil
import stat
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from tqdm import tqdm

from data_prep import tokenize
from data_prep.config import PrepConfig, to_container
from data_prep.errors import ConfigError, InputError, OutputExistsError, OutputWriteError, PrepError
from data_prep.format import (
    COMPLETE_MARKER,
    DOC_ID,
    EMPTY_SPLIT_SHA256,
    FORMAT_VERSION,
    HF_TOKENIZER_FILENAMES,
    MANIFEST_FILENAME,
    PIECE,
    SPLITS,
    TOKENIZER_FILENAME,
    TOKENS,
    IncompleteDatasetError,
    InputFingerprint,
    LengthHistogram,
    Manifest,
    SplitStats,
    ValSplitInfo,
    length_bin,
    mds_columns,
    read_manifest,
    token_dtype_for_vocab,
)
from data_prep.safe_files import index_file_names, is_within, parse_index
from data_prep.safe_write import move, write_bytes
from data_prep.sources import (
    BuiltinSource,
    Document,
    FileSource,
    HFSource,
    SkipCounter,
    Source,
    iter_documents,
    resolve_sources,
)
from data_prep.split import ValSplit, val_split, why_val_is_empty
from data_prep.streaming_compat import ensure_streaming_importable

logger = logging.getLogger(__name__)

__all__ = [
    "check_output",
    "commit_dataset",
    "main",
    "make_work_dir",
    "prep_tokenizer",
    "select_slice",
    "tokenizer_sample",
]

_BATCH_CHARS = 1 << 18
"""Characters per encode call: a few thousand calls a second cost nothing, and the last call of a run is the time the
other encode threads sit idle at its end, so calls are kept short."""
_TASKS_IN_FLIGHT_PER_WORKER = 8
"""Bounded read-ahead (a few MB of text per thread), so a fast reader cannot pull a whole corpus into memory, while
every encode thread has its next call queued when this thread is busy writing a shard."""
_WORK_MARKER = ".prep-work"
"""Empty file created in every work directory right after it: proof that a leftover ``.<name>.tmp-<pid>`` is
prep's own and may be deleted. Removed from the finished dataset after the rename."""
_INDEX = "index.json"
_REPO = Path(__file__).resolve().parents[1]


# ---- main side ---------------------------------------------------------------------------------------


@dataclass
class _Doc:
    doc_id: int
    where: str
    remaining: int
    train_parts: int
    """How many of the document's segments are its train part; those after them are its val part."""
    parts: list[np.ndarray]


@dataclass
class _Task:
    docs: list[_Doc]  # the segment i of the task belongs to docs[i] (one doc may span several tasks)
    texts: list[str]


def _tasks(
    docs: Iterator[Document], cfg: PrepConfig, is_val: ValSplit, skips: SkipCounter, segment: Callable[[str], list[str]]
) -> Iterator[_Task]:
    batch_docs: list[_Doc] = []
    batch_texts: list[str] = []
    size = 0
    for ordinal, doc in enumerate(docs):
        doc_id = ordinal * cfg.num_slices + cfg.slice_index  # unique across the slices of a sliced run
        if not doc.text.strip():
            skips.skip("empty", doc.where)
            continue
        start = is_val.val_start(doc.text)
        train, val = doc.text[:start], doc.text[start:]
        parts = segment(train) if train else []
        train_parts = len(parts)
        if val:
            parts += segment(val)
        entry = _Doc(doc_id, doc.where, len(parts), train_parts, [])
        for part in parts:
            batch_docs.append(entry)
            batch_texts.append(part)
            size += len(part)
            if size >= _BATCH_CHARS:
                yield _Task(batch_docs, batch_texts)
                batch_docs, batch_texts, size = [], [], 0
    if batch_texts:
        yield _Task(batch_docs, batch_texts)


class _SplitWriter:
    """One MDS split plus its counts and its `LengthHistogram`.

    For the histogram's ``spanning_documents`` it keeps, per document of more than one piece (only those can cross
    a shard boundary), four integers: its first and last piece's sample number, its id and its length; `finish`
    holds them against the shard boundaries of the written index.json. A document of one piece costs nothing.
    """

    def __init__(self, out: Path, cfg: PrepConfig, token_dtype: str) -> None:
        from streaming import MDSWriter

        self.out = out
        self.dtype = np.dtype(token_dtype)
        self.max_piece = cfg.max_piece_tokens
        self.writer = MDSWriter(
            out=str(out),
            columns=mds_columns(token_dtype),
            compression="zstd",
            hashes=["xxh64"],
            size_limit=cfg.shard_size_bytes,
        )
        self.documents = self.pieces = self.tokens = 0
        self.bin_documents = [0] * 64
        self.bin_tokens = [0] * 64
        self.cut = {key: array("q") for key in ("first", "last", "doc_id", "length")}
        """The documents of more than one piece: sample numbers of their first and last piece, id, length."""

    def write(self, doc_id: int, tokens: np.ndarray) -> None:
        """Write one document (all its pieces, consecutively); a document without tokens is not written."""
        if not len(tokens):
            return
        tokens = tokens.astype(self.dtype, copy=False)
        first = self.pieces
        for piece, start in enumerate(range(0, len(tokens), self.max_piece)):
            self.writer.write({TOKENS: tokens[start : start + self.max_piece], DOC_ID: doc_id, PIECE: piece})
            self.pieces += 1
        self.documents += 1
        self.tokens += len(tokens)
        b = length_bin(len(tokens))
        self.bin_documents[b] += 1
        self.bin_tokens[b] += len(tokens)
        if self.pieces - first > 1:
            for key, value in (
                ("first", first),
                ("last", self.pieces - 1),
                ("doc_id", doc_id),
                ("length", len(tokens)),
            ):
                self.cut[key].append(value)

    def _histogram(self, shard_samples: list[int]) -> LengthHistogram:
        """The split's histogram, with the documents whose first and last piece lie in different shards of an index
        listing ``shard_samples`` samples per shard, in order."""
        used = max((b + 1 for b, n in enumerate(self.bin_documents) if n), default=0)
        ends = np.cumsum(np.asarray(shard_samples, dtype=np.int64))  # shard k holds samples [ends[k-1], ends[k])
        first, last = (np.frombuffer(self.cut[key], dtype=np.int64) for key in ("first", "last"))
        crossing = np.searchsorted(ends, first, side="right") != np.searchsorted(ends, last, side="right")
        ids, lengths = (np.frombuffer(self.cut[key], dtype=np.int64)[crossing] for key in ("doc_id", "length"))
        return LengthHistogram(
            documents=self.bin_documents[:used],
            tokens=self.bin_tokens[:used],
            spanning_documents={str(i): int(n) for i, n in zip(ids.tolist(), lengths.tolist(), strict=True)},
        )

    def finish(self) -> SplitStats:
        self.writer.finish()
        if not self.pieces:
            # streaming refuses an index without samples, so an empty split is not written at all (the manifest
            # records it as empty); the writer made the directory and its index.json, nothing else
            (self.out / _INDEX).unlink()
            self.out.rmdir()
            return SplitStats(
                documents=0, pieces=0, tokens=0, index_sha256=EMPTY_SPLIT_SHA256, length_histogram=self._histogram([])
            )
        index = (self.out / _INDEX).read_bytes()
        shard_samples = [int(shard["samples"]) for shard in json.loads(index)["shards"]]
        if sum(shard_samples) != self.pieces:  # the writer's own index; a mismatch is a bug, not bad input
            raise RuntimeError(f"{self.out / _INDEX} lists {sum(shard_samples)} samples, {self.pieces} were written")
        return SplitStats(
            documents=self.documents,
            pieces=self.pieces,
            tokens=self.tokens,
            index_sha256=hashlib.sha256(index).hexdigest(),
            length_histogram=self._histogram(shard_samples),
        )


def _results(tasks: Iterator[_Task], model_proto: bytes, workers: int) -> Iterator[tuple[_Task, list[np.ndarray]]]:
    """Encode tasks in order on ``workers`` threads of this process, one single-threaded encode call per task at a
    time on each, with bounded read-ahead.

    SentencePiece releases the GIL while it encodes, so threads scale over the cores like processes would, without
    starting processes or pickling texts and ids between them, and this thread reads the next documents and writes
    shards meanwhile. One encode thread per call (not one call spread over all of them) keeps every core busy
    across task boundaries: a multi-threaded call ends on its slowest segment with the other threads idle.
    """
    processor = tokenize.load_processor(model_proto)
    with ThreadPoolExecutor(workers, thread_name_prefix="encode") as executor:
        yield from _in_order(
            ((t, executor.submit(tokenize.encode_segments, processor, t.texts)) for t in tasks),
            workers * _TASKS_IN_FLIGHT_PER_WORKER,
        )


def _in_order(
    submitted: Iterator[tuple[_Task, Future[list[np.ndarray]]]], in_flight: int
) -> Iterator[tuple[_Task, list[np.ndarray]]]:
    """The results of submitted tasks in submission order, at most ``in_flight`` submitted ahead (so a fast reader
    cannot pull a whole corpus into memory)."""
    pending: deque[tuple[_Task, Future[list[np.ndarray]]]] = deque()
    for item in submitted:
        pending.append(item)
        if len(pending) >= in_flight:
            done, result = pending.popleft()
            yield done, result.result()
    while pending:
        done, result = pending.popleft()
        yield done, result.result()


def _write_documents(
    sources: list[Source],
    cfg: PrepConfig,
    is_val: ValSplit,
    model_proto: bytes,
    vocab_size: int,
    tmp: Path,
    skips: SkipCounter,
) -> dict[str, _SplitWriter]:
    """Every document of ``sources`` encoded and written to its split's writer; the writers, not yet finished."""
    token_dtype = token_dtype_for_vocab(vocab_size)
    writers = {split: _SplitWriter(tmp / split, cfg, token_dtype) for split in SPLITS}
    tokens_done = 0
    start = time.perf_counter()
    bar = tqdm(desc="tokenize", unit="doc", disable=not cfg.progress, dynamic_ncols=True)
    tasks = _tasks(iter_documents(sources, skips), cfg, is_val, skips, tokenize.segmenter(model_proto))
    workers = cfg.num_proc * tokenize.encode_threads(cfg.num_proc, cfg.encode_threads)
    for task, encoded in _results(tasks, model_proto, workers):
        for doc, ids in zip(task.docs, encoded, strict=True):
            doc.parts.append(ids)
            doc.remaining -= 1
            if doc.remaining:
                continue
            train, val = _joined(doc.parts[: doc.train_parts]), _joined(doc.parts[doc.train_parts :])
            doc.parts = []
            bar.update(1)
            tokens = len(train) + len(val)
            if tokens < cfg.min_tokens:  # the whole document, also when its tail is held out
                skips.skip("too_short", doc.where, f"{tokens} < min_tokens={cfg.min_tokens} tokens")
                continue
            for split, ids in (("train", train), ("val", val)):
                if len(ids):
                    writers[split].write(doc.doc_id, ids)
            tokens_done += tokens
        bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
    bar.close()
    return writers


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The ids of consecutive segments as one array (empty for none)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, np.uint32)


def _check_split_sizes(writers: dict[str, _SplitWriter], cfg: PrepConfig, is_val: ValSplit) -> None:
    """Refuse a dataset without training documents; warn that an empty val split is absent."""
    if writers["train"].documents == 0 and cfg.num_slices == 1:  # one slice of several may legitimately be empty
        raise InputError(
            f"no document reached the train split ({writers['val'].documents} went to val with "
            f"val_fraction={cfg.val_fraction}); nothing was written: add input documents or lower "
            "val_fraction / min_tokens"
        )
    if cfg.val_fraction > 0 and writers["val"].documents == 0:
        logger.warning(
            "val split is empty with val_fraction=%s: %s; %s has no val/ directory (manifest: 0 val tokens): add "
            "documents, or train with eval off",
            cfg.val_fraction,
            why_val_is_empty(is_val.unit, cfg.val_fraction),
            cfg.output,
        )


def prep_tokenizer(sources: list[Source], cfg: PrepConfig, is_val: ValSplit) -> tokenize.PrepTokenizer:
    """The tokenizer a run encodes with: the ``tokenizer.json`` folder of ``tokenizer.type=hf``, else the SentencePiece
    model of `tokenizer_model_bytes`; read and checked before any work. A sliced run's tokenizer step writes these
    files once for every slice (``data_prep.merge.prepare_tokenizer``)."""
    if cfg.tokenizer.type == "hf":
        return tokenize.hf_prep_tokenizer(str(cfg.tokenizer.path))
    return tokenize.sentencepiece_prep_tokenizer(*tokenizer_model_bytes(sources, cfg, is_val))


def tokenizer_model_bytes(sources: list[Source], cfg: PrepConfig, is_val: ValSplit) -> tuple[bytes, bool]:
    """The given ``tokenizer.model``, or one trained on a sample of the train parts of the documents (``is_val`` keeps
    all val text out of it); and whether it was trained."""
    if cfg.tokenizer.model is not None:
        model = Path(cfg.tokenizer.model).read_bytes()
        try:
            tokenize.load_sentencepiece(model)
        except RuntimeError:
            raise ConfigError(f"bad value tokenizer.model={cfg.tokenizer.model!r}: not a SentencePiece model") from None
        return model, False
    return tokenize.train_tokenizer(tokenizer_sample(sources, cfg, is_val), cfg.tokenizer, cfg.num_proc), True


def tokenizer_sample(sources: list[Source], cfg: PrepConfig, is_val: ValSplit) -> Iterator[str]:
    """The texts the tokenizer is trained on: the train parts of documents drawn by an independent hash, about twice
    ``tokenizer.sample_bytes`` of them (the trainer stops at ``sample_bytes``)."""
    sizes = [s.size_bytes() for s in sources]
    total = sum(s for s in sizes if s is not None) if None not in sizes else None
    # Oversample 2x: compressed files, skipped records and the val share make file sizes overestimate text.
    rate = 1.0 if total is None else min(1.0, 2.0 * cfg.tokenizer.sample_bytes / max(total, 1))
    # Read with a silent throwaway counter: skips are counted and reported once, in the tokenize pass.
    return _train_parts(iter_documents(sources, SkipCounter(strict=cfg.strict, quiet=True)), cfg, is_val, rate)


def _train_parts(docs: Iterator[Document], cfg: PrepConfig, is_val: ValSplit, rate: float) -> Iterator[str]:
    """The train part of each document a second, independent hash (seed + 1) picks at ``rate``, so the sample is
    spread over the whole corpus; the tokenizer never sees val text. The progress bar counts the documents with a
    train part, which the sample is drawn from (not val documents, not empty ones)."""
    with tqdm(desc="tokenizer sample (train documents)", unit="doc", disable=not cfg.progress) as bar:
        for doc in docs:
            if not doc.text.strip():
                continue
            train = doc.text[: is_val.val_start(doc.text)]
            if not train:
                continue
            bar.update(1)
            if xxhash.xxh64_intdigest(doc.text.encode("utf-8"), seed=cfg.split_seed + 1) < rate * 2.0**64:
                yield train


def select_slice(sources: list[Source], cfg: PrepConfig) -> list[Source]:
    """The input files of slice ``cfg.slice_index`` of ``cfg.num_slices``: a contiguous run, in input order.

    Contiguous runs (not round-robin) keep the documents of the concatenated slices in the order a single run
    reads them, so a merged dataset holds the same samples in the same order. A built-in corpus is sliced
    by its files.

    Raises:
        ConfigError: an input that is not a local file (``hf:``), or fewer files than slices.
    """
    if cfg.num_slices == 1:
        return sources
    if len(sources) == 1 and isinstance(sources[0], HFSource):
        return [sources[0].sliced(cfg.num_slices, cfg.slice_index)]
    files: list[Source] = []
    for source in sources:
        if isinstance(source, BuiltinSource):
            files.extend(source.files)
        elif isinstance(source, FileSource):
            files.append(source)
        else:
            raise ConfigError(
                f"num_slices={cfg.num_slices} slices local input files, or one hf: input alone; {source.name} "
                "cannot be sliced beside other inputs (prepare it on its own, or without num_slices)"
            )
    if len(files) < cfg.num_slices:
        raise ConfigError(
            f"num_slices={cfg.num_slices} is more than the {len(files)} input files; use at most {len(files)} slices"
        )
    start = cfg.slice_index * len(files) // cfg.num_slices
    stop = (cfg.slice_index + 1) * len(files) // cfg.num_slices
    return files[start:stop]


def _software() -> dict[str, str]:
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        "sentencepiece": version("sentencepiece"),
        "tokenizers": version("tokenizers"),
        "mosaicml-streaming": version("mosaicml-streaming"),
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_plain_file(path: Path) -> bool:
    """A regular file itself, not a symbolic link to one (prep never writes links)."""
    return stat.S_ISREG(path.lstat().st_mode)


def _is_dir(path: Path) -> bool:
    return stat.S_ISDIR(path.lstat().st_mode)


def _shard_names(index_path: Path) -> set[str] | None:
    """The file names an MDS index lists (compressed and decompressed shards), or None if it is not a valid one
    (the same check every reader runs, `safe_files.check_index`)."""
    try:
        index = parse_index(index_path.read_bytes(), str(index_path))
    except (OSError, ValueError):
        return None
    return {name for shard in index["shards"] for name in index_file_names(shard)} | {_INDEX}


def _split_paths(split_dir: Path) -> tuple[list[Path], list[Path]]:
    """(paths prep wrote, other paths) in one split directory: index.json and the shards it lists are prep's.

    Reading a split in place lets streaming decompress a listed shard beside its zip; both names are listed.
    """
    names = _shard_names(split_dir / _INDEX) if (split_dir / _INDEX).is_file() else None
    if names is None:
        return [], [split_dir]
    ours: list[Path] = []
    other: list[Path] = []
    for entry in sorted(split_dir.iterdir()):
        (ours if entry.name in names and is_plain_file(entry) else other).append(entry)
    return ours, other


def _refuse(root: Path, why: str) -> OutputExistsError:
    return OutputExistsError(
        f"output {root} {why}; nothing was deleted: remove or move it yourself, or choose another output"
    )


def dataset_paths(root: Path) -> list[Path]:
    """Every path of the complete dataset at ``root``, each file before the directory holding it.

    Raises:
        OutputExistsError: ``root`` is not a complete dataset written by prep (no valid manifest.json with a
            matching `_COMPLETE`), or it holds anything prep did not write, or a link where prep writes a file.
    """
    if root.is_symlink() or not root.is_dir():
        raise _refuse(root, "exists and is not a directory (a file or a symbolic link)")
    try:
        read_manifest(root)
    except (IncompleteDatasetError, OSError, ValueError, KeyError, TypeError):
        raise _refuse(
            root,
            f"exists but is not a complete dataset written by prep (no valid {MANIFEST_FILENAME} "
            f"with a matching {COMPLETE_MARKER})",
        ) from None
    files: list[Path] = []
    dirs: list[Path] = []
    other: list[Path] = []
    for entry in sorted(root.iterdir()):
        prep_files = (MANIFEST_FILENAME, COMPLETE_MARKER, TOKENIZER_FILENAME, *HF_TOKENIZER_FILENAMES, _WORK_MARKER)
        if entry.name in prep_files and is_plain_file(entry):
            files.append(entry)
        elif entry.name in SPLITS and _is_dir(entry):
            ours, theirs = _split_paths(entry)
            files.extend(ours)
            other.extend(theirs)
            dirs.append(entry)
        else:
            other.append(entry)
    if other:
        names = ", ".join(str(p.relative_to(root)) for p in other[:5]) + (" ..." if len(other) > 5 else "")
        raise _refuse(root, f"holds files prep did not write ({names})")
    return files + dirs


def delete_dataset(root: Path) -> None:
    """Delete the dataset at ``root`` path by path (never through a link); warn instead of failing, since by
    now the new dataset is in place. Anything prep did not write is left where it is."""
    try:
        for path in dataset_paths(root):
            if _is_dir(path):
                path.rmdir()
            else:
                path.unlink()
        root.rmdir()
    except (PrepError, OSError) as exc:
        logger.warning("could not fully remove the previous dataset at %s (%s); remove it by hand", root, exc)


def is_work_dir(path: Path) -> bool:
    """Whether ``path`` is a work directory prep created (a real directory holding the work marker)."""
    marker = path / _WORK_MARKER
    return _is_dir(path) and marker.exists() and is_plain_file(marker)


def remove_stale_work_dirs(out: Path) -> None:
    """Remove work directories (``.tmp-``) and replaced datasets (``.old-``) of crashed runs on the same output
    (their pid is gone), each only when it provably is prep's."""
    if not out.parent.is_dir():
        return
    for stale in out.parent.iterdir():
        kind, _, pid = stale.name.rpartition("-")
        if not (kind in (f".{out.name}.tmp", f".{out.name}.old") and pid.isdigit()) or _pid_alive(int(pid)):
            continue
        if kind.endswith(".old") and not out.exists():
            # killed between moving the old dataset aside and moving the new one in: this is the only copy
            logger.warning(
                "leaving %s: the previous dataset of an interrupted replacement, and %s does not exist; "
                "rename it back to keep it",
                stale,
                out,
            )
        elif kind.endswith(".old"):
            logger.warning("removing %s, the previous dataset of an interrupted replacement", stale)
            delete_dataset(stale)
        elif is_work_dir(stale):
            logger.warning("removing %s left by an interrupted run", stale)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            logger.warning("leaving %s: named like a prep work directory but not marked as one", stale)


def make_work_dir(out: Path) -> Path:
    """Create this process's hidden, marked work directory next to ``out`` (and ``out``'s parents).

    Raises:
        OutputWriteError: the directory cannot be created (read-only or missing permissions, a file in the way).
        OutputExistsError: a directory of that name exists that prep did not create.
    """
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        if not is_work_dir(tmp):
            raise _refuse(tmp, "is named like this run's work directory but was not made by prep")
        shutil.rmtree(tmp)  # a previous run in this very process (tests) left it
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        write_bytes(tmp / _WORK_MARKER, b"")
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputWriteError(
            f"cannot create {exc.filename or tmp} ({exc.strerror or exc}): output={out} needs "
            "a writable parent directory; fix its permissions or choose another output"
        ) from None
    return tmp


def commit_dataset(tmp: Path, out: Path, manifest: Manifest, overwrite: bool) -> None:
    """Write the manifest, then the completion marker (its sha256) last, and move ``tmp`` into place at ``out``.

    An existing ``out`` is replaced only with ``overwrite`` and only if it is a dataset prep wrote (checked again
    here: it may have changed during the run); it is deleted only after the new one is in place.
    """
    data = manifest.to_json().encode()
    write_bytes(tmp / MANIFEST_FILENAME, data, fsync=True)
    write_bytes(tmp / COMPLETE_MARKER, (hashlib.sha256(data).hexdigest() + "\n").encode(), fsync=True)
    _commit(tmp, out, overwrite)


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists() or out.is_symlink():
        if not overwrite:  # someone created it while we were working
            raise OutputExistsError(f"output {out} appeared during the run; pass overwrite=true to replace it")
        dataset_paths(out)
        # Move the old dataset aside first, so there is never a moment with neither a complete old nor new one.
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        move(out, old)
        try:
            move(tmp, out)
        except BaseException:
            move(old, out)
            raise
        delete_dataset(old)
    else:
        move(tmp, out)
    (out / _WORK_MARKER).unlink(missing_ok=True)  # the marker is for work directories, not datasets
    dir_fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _check_output_location(out: Path, cfg: PrepConfig, sources: list[Source]) -> None:
    """Refuse an output that replacing (or writing) would harm: a link, a directory holding the working
    directory, the repository or the home directory, or one holding an input or the tokenizer being used."""
    if out.is_symlink():
        raise ConfigError(f"output={out} is a symbolic link; name the real directory instead")
    resolved = out.resolve()
    for label, place in (("the current directory", Path.cwd()), ("the repository", _REPO), ("home", Path.home())):
        if is_within(place, resolved):
            raise ConfigError(
                f"output={out} is or contains {label} ({place}); choose a dedicated dataset directory such as data/mine"
            )
    inputs: list[Path] = [Path(entry) for entry in cfg.input if Path(entry).exists()]
    for source in sources:
        if isinstance(source, FileSource):
            inputs.append(source.path)
        elif isinstance(source, BuiltinSource):
            inputs.append(source.root)
    for path in inputs:
        if is_within(path, resolved):
            raise ConfigError(
                f"output={out} contains the input {path}; writing the dataset there could delete it: "
                "choose an output outside the input"
            )
    for key, given in (("model", cfg.tokenizer.model), ("path", cfg.tokenizer.path)):
        if given is not None and is_within(Path(given), resolved):
            raise ConfigError(
                f"output={out} contains tokenizer.{key}={given}, which replacing the "
                "output would delete; copy the tokenizer elsewhere first"
            )


def check_output(out: Path, cfg: PrepConfig, sources: list[Source]) -> None:
    """Refuse, before any work, an output this run may not write or replace (see `main`'s Raises)."""
    _check_output_location(out, cfg, sources)
    if out.exists():
        if not cfg.overwrite:
            raise OutputExistsError(f"output {out} already exists; pass overwrite=true to replace it")
        dataset_paths(out)  # replace only a dataset prep wrote, and only if nothing else lives in it


def _write_error(exc: OSError, tmp: Path, out: Path) -> str:
    where = exc.filename or tmp
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"the disk is full (or over quota); free space under {out.parent} or choose another output"
    else:
        fix = exc.strerror or str(exc)
    return f"cannot write {where}: {fix}. The unfinished {tmp.name} was removed; {out} is as it was before the run"


def _import_streaming_in_background() -> None:
    """Start importing ``streaming`` (whose package imports torch, transformers and scikit-learn: 7-9 s on 2 cores)
    on a thread, so it overlaps the tokenizer training and the first reads instead of delaying the first shard.
    The shard writer's own import then waits for it (Python's per-module import lock) or finds it done; a failed
    import here is left for that import to raise, with its traceback, in the main thread."""

    def load() -> None:
        try:
            importlib.import_module("streaming")
        except Exception:  # re-raised by the main thread's own import
            pass

    threading.Thread(target=load, name="import-streaming", daemon=True).start()


def main(cfg: PrepConfig) -> Manifest:
    """Prepare a dataset as described in the module docstring.

    Args:
        cfg: a validated config (see `data_prep.config.load_config`).

    Returns:
        The manifest that was written.

    Raises:
        OutputExistsError: the output exists and ``cfg.overwrite`` is false, or it is not a dataset prep wrote
            (checked before any work).
        ConfigError: an output that holds an input, the tokenizer, the working directory or the repository, or
            is a link (checked before any work); SentencePiece rejected the tokenizer settings.
        OutputWriteError: the output's parent is not writable (before any work), or writing failed (disk full);
            the work directory is removed and any previous dataset left intact.
        InputError: unreadable input or, under ``cfg.strict``, a malformed record; no train documents.
    """
    out = Path(cfg.output).absolute()
    corpus = resolve_sources(cfg)
    sources = select_slice(corpus, cfg)
    check_output(out, cfg, sources)
    ensure_streaming_importable()
    _import_streaming_in_background()
    remove_stale_work_dirs(out)
    tmp = make_work_dir(out)
    started = time.perf_counter()
    try:
        manifest = _prepare(sources, val_split(corpus, cfg), cfg, tmp)
        commit_dataset(tmp, out, manifest, cfg.overwrite)
    except PrepError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputWriteError(_write_error(exc, tmp, out)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - started
    splits = manifest.splits
    total_tokens = sum(s.tokens for s in splits.values())
    logger.info(
        "wrote %s in %.1fs: train %d docs / %d tokens, val %d docs / %d tokens (%s), %.0f tokens/s; skipped %s",
        out,
        seconds,
        splits["train"].documents,
        splits["train"].tokens,
        splits["val"].documents,
        splits["val"].tokens,
        "whole documents" if manifest.val_split.unit == "documents" else "the tail of every document",
        total_tokens / max(seconds, 1e-9),
        manifest.skipped or "none",
    )
    return manifest


def _prepare(sources: list[Source], is_val: ValSplit, cfg: PrepConfig, tmp: Path) -> Manifest:
    """Tokenizer and splits into ``tmp``; the manifest describing them."""
    tokenizer = prep_tokenizer(sources, cfg, is_val)
    for name, data in tokenizer.files.items():
        write_bytes(tmp / name, data, fsync=True)
    info = tokenizer.info
    skips = SkipCounter(strict=cfg.strict)
    writers = _write_documents(sources, cfg, is_val, tokenizer.model, info.vocab_size, tmp, skips)
    _check_split_sizes(writers, cfg, is_val)
    # Finishing compresses the last shard of each split (0.12 s for the built-in corpus' 20 MB train shard) and
    # fingerprinting reads every input again (0.07 s for its 1901 files): both release the GIL, so they overlap
    # on two cores instead of following each other while the encode threads are done.
    finishing_failed = threading.Event()

    def fingerprints() -> list[InputFingerprint]:
        done = []
        for source in sources:
            if finishing_failed.is_set():  # its error is raised after this input, not after hashing the corpus
                break
            done.append(source.fingerprint(content=cfg.fingerprint == "content"))
        return done

    with ThreadPoolExecutor(1, thread_name_prefix="fingerprint") as side:
        pending = side.submit(fingerprints)
        try:
            splits = {split: writer.finish() for split, writer in writers.items()}
        except BaseException:
            finishing_failed.set()
            raise
        inputs = pending.result()
    return Manifest(
        format_version=FORMAT_VERSION,
        token_dtype=token_dtype_for_vocab(info.vocab_size),
        tokenizer=info,
        splits=splits,
        skipped=dict(sorted(skips.counts.items())),
        inputs=inputs,
        config=to_container(cfg),
        software=_software(),
        val_split=ValSplitInfo(unit=is_val.unit, lowest_hash_fallback=is_val.fallback is not None),
    )

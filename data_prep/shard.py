"""``make prep``: documents -> SentencePiece ids -> ``train/`` and ``val/`` MDS datasets, written atomically.

`main` writes everything into a hidden temporary sibling of the output (``.<name>.tmp-<pid>``), writes
manifest.json and then the `_COMPLETE` marker holding the manifest's sha256, and only then renames the
directory into place. A crash at any point leaves either no output or the previous complete one; the
trainer's `data_prep.format.read_manifest` refuses anything without a matching marker.
"""

import hashlib
import logging
import multiprocessing as mp
import os
import platform
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path

import numpy as np
import xxhash
from tqdm import tqdm

from data_prep import tokenize
from data_prep.config import PrepConfig, to_container
from data_prep.errors import ConfigError, OutputExistsError
from data_prep.format import (
    COMPLETE_MARKER,
    DOC_ID,
    FORMAT_VERSION,
    MANIFEST_FILENAME,
    PIECE,
    SPLITS,
    TOKENIZER_FILENAME,
    TOKENS,
    Manifest,
    SplitStats,
    mds_columns,
    token_dtype_for_vocab,
)
from data_prep.sources import (
    BuiltinSource,
    Document,
    FileSource,
    SkipCounter,
    Source,
    iter_documents,
    resolve_sources,
)
from data_prep.streaming_compat import ensure_streaming_importable

logger = logging.getLogger(__name__)

__all__ = ["is_val", "main", "select_slice"]

_BATCH_CHARS = 1 << 21
"""Characters per task sent to a worker: large enough to amortize pickling, small enough to balance."""
_TASKS_IN_FLIGHT_PER_PROC = 4
"""Bounded read-ahead, so a fast reader cannot pull a whole corpus into memory."""


def is_val(text: str, val_fraction: float, seed: int) -> bool:
    """Whether a document belongs to the val split: a pure function of its text (and the seed).

    Hashing the content (not a position or a random draw) makes the split independent of file order and
    process count, and puts exact duplicates in the same split.
    """
    return xxhash.xxh64_intdigest(text.encode("utf-8"), seed=seed) < val_fraction * 2.0**64


# ---- worker side -------------------------------------------------------------------------------------

_worker_processor = None


def _init_worker(model_proto: bytes) -> None:
    global _worker_processor
    _worker_processor = tokenize.load_processor(model_proto)


def _encode_task(texts: list[str]) -> list[np.ndarray]:
    assert _worker_processor is not None, "worker used before _init_worker"
    return tokenize.encode_segments(_worker_processor, texts)


# ---- main side ---------------------------------------------------------------------------------------


@dataclass
class _Doc:
    doc_id: int
    split: str
    where: str
    remaining: int
    parts: list[np.ndarray]


@dataclass
class _Task:
    docs: list[_Doc]  # the segment i of the task belongs to docs[i] (one doc may span several tasks)
    texts: list[str]


def _tasks(docs: Iterator[Document], cfg: PrepConfig, skips: SkipCounter) -> Iterator[_Task]:
    batch_docs: list[_Doc] = []
    batch_texts: list[str] = []
    size = 0
    for ordinal, doc in enumerate(docs):
        doc_id = ordinal * cfg.num_slices + cfg.slice_index  # unique across the slices of a sliced run
        if not doc.text.strip():
            skips.skip("empty", doc.where)
            continue
        split = "val" if is_val(doc.text, cfg.val_fraction, cfg.split_seed) else "train"
        parts = tokenize.segments(doc.text, tokenize.SEGMENT_CHARS)
        entry = _Doc(doc_id, split, doc.where, len(parts), [])
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
    """One MDS split plus its counts."""

    def __init__(self, out: Path, cfg: PrepConfig, token_dtype: str) -> None:
        from streaming import MDSWriter

        self.out = out
        self.dtype = np.dtype(token_dtype)
        self.max_piece = cfg.max_piece_tokens
        self.writer = MDSWriter(out=str(out), columns=mds_columns(token_dtype), compression="zstd",
                                hashes=["xxh64"], size_limit=cfg.shard_size_bytes)  # fmt: skip
        self.documents = self.pieces = self.tokens = 0

    def write(self, doc_id: int, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        for piece, start in enumerate(range(0, len(tokens), self.max_piece)):
            self.writer.write({TOKENS: tokens[start : start + self.max_piece], DOC_ID: doc_id, PIECE: piece})
            self.pieces += 1
        self.documents += 1
        self.tokens += len(tokens)

    def finish(self) -> SplitStats:
        self.writer.finish()
        index_hash = hashlib.sha256((self.out / "index.json").read_bytes()).hexdigest()
        return SplitStats(documents=self.documents, pieces=self.pieces, tokens=self.tokens, index_sha256=index_hash)


def _results(tasks: Iterator[_Task], model_proto: bytes, num_proc: int) -> Iterator[tuple[_Task, list[np.ndarray]]]:
    """Encode tasks in order, in-process for num_proc=1, else over a pool with bounded read-ahead."""
    if num_proc == 1:
        processor = tokenize.load_processor(model_proto)
        for task in tasks:
            yield task, tokenize.encode_segments(processor, task.texts)
        return
    # fork would copy the parent's streaming/transformers state into each worker; spawn starts clean
    with mp.get_context("spawn").Pool(num_proc, initializer=_init_worker, initargs=(model_proto,)) as pool:
        pending: deque[tuple[_Task, AsyncResult[list[np.ndarray]]]] = deque()
        for task in tasks:
            pending.append((task, pool.apply_async(_encode_task, (task.texts,))))
            if len(pending) >= num_proc * _TASKS_IN_FLIGHT_PER_PROC:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


def _write_splits(sources: list[Source], cfg: PrepConfig, model_proto: bytes, vocab_size: int, tmp: Path,
                  skips: SkipCounter) -> dict[str, SplitStats]:  # fmt: skip
    token_dtype = token_dtype_for_vocab(vocab_size)
    writers = {split: _SplitWriter(tmp / split, cfg, token_dtype) for split in SPLITS}
    tokens_done = 0
    start = time.perf_counter()
    bar = tqdm(desc="tokenize", unit="doc", disable=not cfg.progress, dynamic_ncols=True)
    tasks = _tasks(iter_documents(sources, skips), cfg, skips)
    for task, encoded in _results(tasks, model_proto, cfg.num_proc):
        for doc, ids in zip(task.docs, encoded, strict=True):
            doc.parts.append(ids)
            doc.remaining -= 1
            if doc.remaining:
                continue
            tokens = doc.parts[0] if len(doc.parts) == 1 else np.concatenate(doc.parts)
            doc.parts = []
            bar.update(1)
            if len(tokens) < cfg.min_tokens:
                skips.skip("too_short", doc.where, f"{len(tokens)} < min_tokens={cfg.min_tokens} tokens")
                continue
            writers[doc.split].write(doc.doc_id, tokens)
            tokens_done += len(tokens)
        bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
    bar.close()
    stats = {split: writer.finish() for split, writer in writers.items()}
    if cfg.val_fraction > 0 and stats["val"].documents == 0:
        logger.warning("val split is empty: no document hashed into val_fraction=%s", cfg.val_fraction)
    return stats


def _in_train_sample(doc: Document, cfg: PrepConfig, rate: float) -> bool:
    if is_val(doc.text, cfg.val_fraction, cfg.split_seed):
        return False  # the tokenizer never sees val text
    # a second, independent hash (seed + 1) picks the sample, so it is spread over the whole corpus
    return xxhash.xxh64_intdigest(doc.text.encode("utf-8"), seed=cfg.split_seed + 1) < rate * 2.0**64


def _tokenizer_model(sources: list[Source], cfg: PrepConfig) -> tuple[bytes, bool]:
    if cfg.tokenizer.model is not None:
        model = Path(cfg.tokenizer.model).read_bytes()
        try:
            tokenize.load_processor(model)
        except RuntimeError:
            raise ConfigError(f"bad value tokenizer.model={cfg.tokenizer.model!r}: not a SentencePiece model") from None
        return model, False
    sizes = [s.size_bytes() for s in sources]
    total = sum(s for s in sizes if s is not None) if None not in sizes else None
    # Oversample 2x: compressed files, skipped records and the val share make file sizes overestimate text.
    rate = 1.0 if total is None else min(1.0, 2.0 * cfg.tokenizer.sample_bytes / max(total, 1))
    # Read with a silent throwaway counter: skips are counted and reported once, in the tokenize pass.
    docs = iter_documents(sources, SkipCounter(strict=cfg.strict, quiet=True))
    sample = (d.text for d in tqdm(docs, desc="tokenizer sample", unit="doc", disable=not cfg.progress)
              if d.text.strip() and _in_train_sample(d, cfg, rate))  # fmt: skip
    return tokenize.train_tokenizer(sample, cfg.tokenizer, num_threads=cfg.num_proc), True


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
    files: list[Source] = []
    for source in sources:
        if isinstance(source, BuiltinSource):
            files.extend(source.files)
        elif isinstance(source, FileSource):
            files.append(source)
        else:
            raise ConfigError(f"num_slices={cfg.num_slices} slices local input files; {source.name} cannot be "
                              "sliced (prepare it without num_slices)")  # fmt: skip
    if len(files) < cfg.num_slices:
        raise ConfigError(f"num_slices={cfg.num_slices} is more than the {len(files)} input files; "
                          f"use at most {len(files)} slices")  # fmt: skip
    start = cfg.slice_index * len(files) // cfg.num_slices
    stop = (cfg.slice_index + 1) * len(files) // cfg.num_slices
    return files[start:stop]


def _software() -> dict[str, str]:
    from importlib.metadata import version

    return {"python": platform.python_version(), "sentencepiece": version("sentencepiece"),
            "mosaicml-streaming": version("mosaicml-streaming")}  # fmt: skip


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(out: Path) -> None:
    """Remove temporaries left by crashed runs on the same output (their pid is gone)."""
    for stale in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = stale.name.rpartition("-")
        if kind.endswith((".tmp", ".old")) and pid.isdigit() and not _pid_alive(int(pid)):
            logger.warning("removing %s left by an interrupted run", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit_dataset(tmp: Path, out: Path, manifest: Manifest, overwrite: bool) -> None:
    """Write the manifest, then the completion marker (its sha256) last, and move ``tmp`` into place at ``out``."""
    data = manifest.to_json().encode()
    _fsync_write(tmp / MANIFEST_FILENAME, data)
    _fsync_write(tmp / COMPLETE_MARKER, (hashlib.sha256(data).hexdigest() + "\n").encode())
    _commit(tmp, out, overwrite)


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:  # someone created it while we were working
            raise OutputExistsError(f"output {out} appeared during the run; pass overwrite=true to replace it")
        # Move the old dataset aside first, so there is never a moment with neither a complete old nor new one.
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    dir_fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def main(cfg: PrepConfig) -> Manifest:
    """Prepare a dataset as described in the module docstring.

    Args:
        cfg: a validated config (see `data_prep.config.load_config`).

    Returns:
        The manifest that was written.

    Raises:
        OutputExistsError: the output exists and ``cfg.overwrite`` is false (checked before any work).
        InputError: unreadable input or, under ``cfg.strict``, a malformed record.
        ConfigError: SentencePiece rejected the tokenizer settings.
    """
    out = Path(cfg.output).absolute()
    if out.exists() and not cfg.overwrite:
        raise OutputExistsError(f"output {out} already exists; pass overwrite=true to replace it")
    sources = select_slice(resolve_sources(cfg), cfg)
    ensure_streaming_importable()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a previous run in this very process (tests) may have left it
    tmp.mkdir()
    started = time.perf_counter()
    try:
        model_proto, trained = _tokenizer_model(sources, cfg)
        _fsync_write(tmp / TOKENIZER_FILENAME, model_proto)
        info = tokenize.tokenizer_info(model_proto, trained)
        skips = SkipCounter(strict=cfg.strict)
        splits = _write_splits(sources, cfg, model_proto, info.vocab_size, tmp, skips)
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            token_dtype=token_dtype_for_vocab(info.vocab_size),
            tokenizer=info,
            splits=splits,
            skipped=dict(sorted(skips.counts.items())),
            inputs=[s.fingerprint(content=cfg.fingerprint == "content") for s in sources],
            config=to_container(cfg),
            software=_software(),
        )
        commit_dataset(tmp, out, manifest, cfg.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - started
    total_tokens = sum(s.tokens for s in splits.values())
    logger.info(
        "wrote %s in %.1fs: train %d docs / %d tokens, val %d docs / %d tokens, %.0f tokens/s; skipped %s",
        out, seconds, splits["train"].documents, splits["train"].tokens, splits["val"].documents,
        splits["val"].tokens, total_tokens / max(seconds, 1e-9), manifest.skipped or "none",
    )  # fmt: skip
    return manifest

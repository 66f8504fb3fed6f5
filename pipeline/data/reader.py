"""Training data: MDS shards from data prep -> packed ``seq_len`` sequences -> per-rank micro-batches.

Determinism whatever the world size: every rank walks the same *global* token stream (shard order seeded per
epoch, samples in shard order so the pieces of a document stay contiguous, documents joined by the tokenizer's
EOS), cuts it into sequences, shuffles them in windows of ``data.shuffle_window`` sequences, and takes its own
contiguous slice of each global batch. So the set of sequences in global batch ``b`` depends only on the seed,
never on the number of ranks, and the loader state is a few global integers that resume on any world size.
Each rank reads the whole global batch (for the paper config about 1 MB of tokens per step), a negligible
cost next to a training step.

A dataset is untrusted input and is never written to. ``MDSReader`` reads ``index.json`` and checks it
(``data_prep.safe_files``: shard names confined to the split directory, no pickle column) before any shard file is
opened or created, then brings each shard it needs into a private cache directory of this process: a local shard
is read from a regular file only (no symbolic links, FIFOs or devices) and written there, decompressed when only
the compressed file exists; a remote one is downloaded there by streaming's downloader. Every shard's bytes are
hashed against ``index.json`` as they go into the cache (``ShardCorruptError`` names the file), and streaming's
shard reader decodes the samples from the cached copy only. The cache holds the last few shards and is removed
when the reader goes away. ``dataset_fingerprint`` is a content hash of the split's index (which lists every
shard's hash) and the tokenizer; the trainer stores it in each checkpoint and refuses to resume on other data.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_prep import format as fmt
from data_prep.safe_files import (
    INDEX_FILENAME,
    UnsafeColumnError,
    UnsafeDatasetError,
    UnsafeShardPathError,
    check_index,
    check_shard_path,
    is_within,
    open_regular,
    parse_index,
    read_index,
    read_regular,
    stat_regular,
)
from data_prep.streaming_compat import ensure_streaming_importable

if TYPE_CHECKING:
    from pipeline.data.mix import RetrievalMix

log = logging.getLogger(__name__)

__all__ = [
    "Cursor",
    "DataFingerprintError",
    "EmptySplitError",
    "MDSReader",
    "PackedSequences",
    "RankBatches",
    "ShardCorruptError",
    "UnsafeColumnError",
    "UnsafeDatasetError",
    "UnsafeShardPathError",
    "check_fingerprint",
    "check_index",
    "check_shard_path",
    "dataset_fingerprint",
    "eos_id_of",
    "is_remote",
    "read_tokenizer",
]


def is_remote(path: str) -> bool:
    return "://" in path


class ShardCorruptError(ValueError):
    """A shard file's hash differs from the one ``index.json`` recorded at write time."""


class DataFingerprintError(ValueError):
    """The dataset differs from the one the checkpoint was trained on."""


class EmptySplitError(ValueError):
    """A split's index lists no samples."""


_HASH_PREFERENCE = ("xxh3_64", "xxh64", "xxh128", "xxh3_128", "sha256", "sha1", "md5")
"""Order in which a shard hash is picked when ``data.validate_hash`` is unset: fastest first."""
_CACHE_PREFIX = "gca-reader-"
_CACHE_MARKER = ".gca-reader-cache"
"""Written into every private cache directory: with the name pattern, the proof that a leftover is ours."""
_KEEP_SHARDS = 4
"""Shards kept in a private cache: packing reads shards one after another, so the current one and a few before it
(a shuffle window re-read across a shard boundary) are all it needs; older ones are deleted from the cache."""
_DOWNLOAD_TIMEOUT_S = 60


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale_caches(parent: Path, host: str) -> None:
    """Remove private caches that readers of this host left when they were killed (their pid is gone). Only
    directories with our name pattern and marker are touched: nothing else in ``parent`` is provably ours."""
    pattern = re.compile(rf"{re.escape(_CACHE_PREFIX)}{re.escape(host)}-(\d+)-[A-Za-z0-9_]+")
    for entry in parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            st = os.lstat(entry)
        except FileNotFoundError:  # its owner's cleanup, or another reader's, got there first
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and (entry / _CACHE_MARKER).is_file():
            log.info("removing the data cache of a killed reader: %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _remove_cache(path: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # a forked child must not delete its parent's cache
        shutil.rmtree(path, ignore_errors=True)


def make_private_cache(parent: Path) -> Path:
    """A fresh directory under ``parent`` that only this process uses: created by ``mkdtemp`` (mode 0700, a name
    no one else can have taken: host, pid and a random part, so ranks and nodes sharing ``parent`` never
    collide) and checked to be a real directory of ours."""
    host = socket.gethostname().replace("/", "_")
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove_stale_caches(parent, host)
    path = Path(tempfile.mkdtemp(prefix=f"{_CACHE_PREFIX}{host}-{os.getpid()}-", dir=parent))
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UnsafeDatasetError(
            f"data cache {path} is not a private directory of this user; set data.cache_dir "
            "to a directory only you can write"
        )
    (path / _CACHE_MARKER).write_text(f"{host} {os.getpid()}\n")
    return path


class MDSReader:
    """Random access to one split of a prepared dataset, read through a private cache (see the module docstring).

    Args:
        root: dataset directory or remote URL (``s3://...``, ``gs://...``, ``https://...``).
        split: sub-directory (``train`` / ``val``).
        cache_dir: where this reader creates its private cache directory (the system temp dir when None); never
            inside a local ``root``.
        validate_hash: hash algorithm checked on every shard file as it enters the cache; by default the
            fastest one data prep recorded. A shard with no recorded hash is read unchecked (warned).

    Raises:
        FileNotFoundError: no ``index.json``.
        UnsafeDatasetError: an unsafe index, a cache inside the dataset.
        EmptySplitError: the split holds no samples.
    """

    def __init__(self, root: str, split: str, cache_dir: str | None, validate_hash: str | None = None) -> None:
        ensure_streaming_importable()
        from streaming.base.format import reader_from_json

        self.remote: str | None = root.rstrip("/") + "/" + split if is_remote(root) else None
        self.split_dir = Path(root) / split
        parent = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir())
        if self.remote is None:
            if is_within(parent, Path(root)):
                raise UnsafeDatasetError(
                    f"data cache {parent} lies inside the dataset {root}, which is never "
                    "written to; set data.cache_dir (or run_dir) to a directory outside data.path"
                )
            index, self.index_bytes = self._local_index(split)
            self.index_path = str(self.split_dir / INDEX_FILENAME)
        self.cache = make_private_cache(parent)  # only after the local index passed its checks
        self._finalizer = weakref.finalize(self, _remove_cache, self.cache, os.getpid())
        if self.remote is not None:
            self.index_path = f"{self.remote}/{INDEX_FILENAME}"
            self.index_bytes = self._download(INDEX_FILENAME)
            index = parse_index(self.index_bytes, self.index_path)
        self.hash_algo = self._pick_hash(index["shards"], validate_hash)
        self.shards = [reader_from_json(str(self.cache), None, shard) for shard in index["shards"]]
        for shard in self.shards:
            shard.validate(allow_unsafe_types=False)  # streaming's own pickle check, behind check_index
        self.samples_per_shard = np.asarray([s.samples for s in self.shards], dtype=np.int64)
        if int(self.samples_per_shard.sum()) == 0:
            raise EmptySplitError(
                f"data split {self.remote or self.split_dir} holds no samples ({len(self.shards)} "
                f"shards listed in {self.index_path}); re-run data prep on more documents (or a "
                "larger val_fraction), point data.path (eval: data=) at another dataset, or for an "
                "empty val split set train.eval_every=0"
            )
        self._cached: OrderedDict[int, None] = OrderedDict()

    def _local_index(self, split: str) -> tuple[dict[str, Any], bytes]:
        try:
            return read_index(self.split_dir)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"data.path: no MDS split at {self.split_dir} (index.json missing); run data prep "
                f"first or fix data.path / data.{split}_split"
            ) from None

    def close(self) -> None:
        """Delete the private cache now (also done when the reader is garbage-collected or the process exits)."""
        self._finalizer()

    def _download(self, name: str) -> bytes:
        """A remote file's bytes, fetched through a temporary file of the private cache."""
        from streaming.base.storage.download import CloudDownloader

        assert self.remote is not None
        tmp = self.cache / f".download-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        url = f"{self.remote}/{name}"
        downloader = CloudDownloader.get(url)
        try:
            downloader.download(url, str(tmp), _DOWNLOAD_TIMEOUT_S)
            return read_regular(self.cache, tmp.name)
        finally:
            downloader.clean_up()
            tmp.unlink(missing_ok=True)

    def _pick_hash(self, shards: list[dict], requested: str | None) -> str | None:
        def recorded(shard: dict) -> set[str]:
            infos = [info for k in ("raw_data", "zip_data") if (info := shard.get(k))]
            return set.intersection(*(set(i.get("hashes", {})) for i in infos)) if infos else set()

        common = set.intersection(*(recorded(s) for s in shards)) if shards else set()
        if requested is not None:
            if shards and requested not in common:
                raise ValueError(
                    f"data.validate_hash={requested!r}, but {self.index_path} records only "
                    f"{sorted(common) or 'no hashes'} for every shard"
                )
            return requested
        algo = next((a for a in _HASH_PREFERENCE if a in common), None)
        if algo is None and shards:
            log.warning(
                "%s records no shard hash common to all shards; corrupt shards cannot be detected", self.index_path
            )
        return algo

    @property
    def num_shards(self) -> int:
        return len(self.samples_per_shard)

    def _check(self, info: Any, data: bytes, where: str) -> bytes:
        """``data`` if its size and hash match what ``index.json`` records for ``info``."""
        if len(data) != info.bytes:
            raise ShardCorruptError(
                f"Size mismatch: {where}: {len(data)} bytes, but {self.index_path} records "
                f"{info.bytes}; the shard changed since data prep wrote it (re-run data prep)"
            )
        if self.hash_algo is not None:
            from streaming.base.hashing import get_hash

            actual, expected = get_hash(self.hash_algo, data), info.hashes[self.hash_algo]
            if actual != expected:
                raise ShardCorruptError(
                    f"Checksum failure: {where}: {self.hash_algo} {actual}, but {self.index_path} records {expected}; "
                    "the shard changed since data prep wrote it (re-run data prep, or restore the file)"
                )
        return data

    def _fetch(self, info: Any) -> bytes:
        """The checked bytes of one shard file: read from a regular file of the split, or downloaded."""
        if self.remote is not None:
            return self._check(info, self._download(info.basename), f"{self.remote}/{info.basename}")
        where = str(self.split_dir / info.basename)
        with os.fdopen(open_regular(self.split_dir, info.basename), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != info.bytes:  # checked before reading: a shard grown to gigabytes is never loaded
                raise ShardCorruptError(
                    f"Size mismatch: {where}: {size} bytes, but {self.index_path} records "
                    f"{info.bytes}; the shard changed since data prep wrote it (re-run data prep)"
                )
            return self._check(info, f.read(), where)

    def _raw_bytes(self, raw: Any, packed: Any, compression: str | None) -> bytes:
        """A shard file's decoded bytes. Locally the raw file is used when present (a dataset read in place by an
        older version holds both), else the compressed one; remotely the compressed one (a smaller download)."""
        from streaming.base.compression import decompress

        local_raw = self.remote is None and stat_regular(self.split_dir, raw.basename) is not None
        if packed is None or local_raw:
            return self._fetch(raw)
        where = f"{self.remote or self.split_dir}/{raw.basename}"
        return self._check(raw, decompress(compression, self._fetch(packed)), f"{where} (decompressed)")

    def _write_cached(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name`` into the private cache (a temporary name first, so a failed write never
        leaves a partial shard under its real name)."""
        path = self.cache / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache / f".part-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _prepare(self, shard: int) -> None:
        """Bring ``shard`` into the cache (checked), and drop the least recently used shard beyond the limit."""
        reader = self.shards[shard]
        for raw, packed in reader.file_pairs:
            self._write_cached(raw.basename, self._raw_bytes(raw, packed, reader.compression))
        self._cached[shard] = None
        while len(self._cached) > _KEEP_SHARDS:
            old, _ = self._cached.popitem(last=False)
            for raw, _ in self.shards[old].file_pairs:
                (self.cache / raw.basename).unlink(missing_ok=True)

    def sample(self, shard: int, index: int) -> tuple[np.ndarray, int]:
        """Token ids and document id of sample ``index`` of shard ``shard``."""
        if shard in self._cached:
            self._cached.move_to_end(shard)
        else:
            self._prepare(shard)
        sample = self.shards[shard][int(index)]
        return np.asarray(sample[fmt.TOKENS]), int(sample[fmt.DOC_ID])


def read_tokenizer(data_path: str) -> bytes | None:
    """The bytes of ``tokenizer.model`` next to a local dataset, read as a regular file only (a link or FIFO planted
    there is refused, never followed or blocked on); None when there is none, or the dataset is remote.

    Raises:
        UnsafeDatasetError: the file is a link, FIFO, device or directory.
    """
    root = Path(data_path)
    if is_remote(data_path) or stat_regular(root, fmt.TOKENIZER_FILENAME) is None:
        return None
    return read_regular(root, fmt.TOKENIZER_FILENAME)


def dataset_fingerprint(reader: MDSReader, data_path: str) -> dict[str, str | None]:
    """Content fingerprint of the training data: sha256 of the split's ``index.json`` (which records every
    shard's hash, size and sample count) and of ``tokenizer.model`` (``None`` when there is none, or remote)."""
    tokenizer = read_tokenizer(data_path)
    return {
        "index_sha256": hashlib.sha256(reader.index_bytes).hexdigest(),
        "tokenizer_sha256": hashlib.sha256(tokenizer).hexdigest() if tokenizer is not None else None,
    }


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise `DataFingerprintError` naming each component that differs (old vs new hash)."""
    changed = [
        f"{key}: checkpoint {saved.get(key)} vs now {current.get(key)}"
        for key in sorted(current)
        if saved.get(key) != current.get(key)
    ]
    if changed:
        raise DataFingerprintError(
            f"dataset fingerprint mismatch: {where} was trained on other data than data.path now holds ("
            + "; ".join(changed)
            + "); the data order and token ids would silently change. Point data.path at the "
            "original dataset, or start a new run (checkpoint.resume=none)"
        )


@dataclass
class Cursor:
    """A position in the global token stream."""

    epoch: int = 0
    shard_pos: int = 0
    """Index into this epoch's shard order."""
    sample: int = 0
    """Sample within the shard."""
    offset: int = 0
    """Tokens of that sample already consumed (the EOS separator counts as its last token)."""


class PackedSequences:
    """The global, seeded sequence stream: ``next(n)`` returns the next ``n`` sequences of ``seq_len`` tokens.

    Args:
        reader: an ``MDSReader`` (or anything with ``num_shards``, ``samples_per_shard`` and ``sample``).
        seq_len: tokens per sequence.
        seed: data-order seed.
        shuffle: shuffle shards per epoch and sequences within each window.
        window: sequences shuffled together.
        eos_id: token inserted between documents (``None``/negative: none).
    """

    def __init__(
        self, reader: Any, *, seq_len: int, seed: int, shuffle: bool, window: int, eos_id: int | None
    ) -> None:
        self.reader, self.seq_len, self.seed = reader, seq_len, seed
        self.shuffle, self.window = shuffle, window
        self.eos_id = eos_id if eos_id is not None and eos_id >= 0 else None
        self._window_start = Cursor()
        self._window_index = 0
        self._taken = 0
        self._buffer: np.ndarray | None = None
        self._buffer_ids: np.ndarray | None = None
        self._recent: dict[tuple[int, int], tuple[np.ndarray, int]] = {}

    def _shard_order(self, epoch: int) -> np.ndarray:
        order = np.arange(self.reader.num_shards)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        return order

    def _raw(self, shard: int, sample: int) -> tuple[np.ndarray, int]:
        # Two entries suffice: packing reads a sample and peeks at the next one's document id.
        key = (shard, sample)
        if key not in self._recent:
            self._recent = {k: v for k, v in self._recent.items() if k == (shard, sample - 1)}
            self._recent[key] = self.reader.sample(shard, sample)
        return self._recent[key]

    def _sample_tokens(self, shard: int, sample: int) -> np.ndarray:
        """A sample's tokens, plus EOS when the next sample starts another document (or the shard ends)."""
        toks, doc = self._raw(shard, sample)
        toks = toks.astype(np.int64)
        if self.eos_id is not None:
            last = sample + 1 >= self.reader.samples_per_shard[shard]
            if last or self._raw(shard, sample + 1)[1] != doc:
                toks = np.append(toks, self.eos_id)
        return toks

    def _read(self, cur: Cursor, n_tokens: int) -> tuple[np.ndarray, Cursor]:
        out, need = [], n_tokens
        cur = Cursor(**asdict(cur))
        order = self._shard_order(cur.epoch)
        while need:
            if cur.shard_pos >= len(order):
                cur = Cursor(epoch=cur.epoch + 1)
                order = self._shard_order(cur.epoch)
                continue
            shard = int(order[cur.shard_pos])
            if cur.sample >= self.reader.samples_per_shard[shard]:
                cur.shard_pos, cur.sample, cur.offset = cur.shard_pos + 1, 0, 0
                continue
            toks = self._sample_tokens(shard, cur.sample)
            piece = toks[cur.offset : cur.offset + need]
            out.append(piece)
            need -= len(piece)
            cur.offset += len(piece)
            if cur.offset >= len(toks):
                cur.sample, cur.offset = cur.sample + 1, 0
        return np.concatenate(out), cur

    def _fill(self) -> None:
        """Materialize the current window: ``window`` sequences, permuted with a per-window seed."""
        flat, _ = self._read(self._window_start, self.window * self.seq_len)
        seqs = flat.reshape(self.window, self.seq_len)
        ids = self._window_index * self.window + np.arange(self.window)
        if self.shuffle:
            perm = np.random.default_rng([self.seed, 1, self._window_index]).permutation(self.window)
            seqs, ids = seqs[perm], ids[perm]
        self._buffer, self._buffer_ids = seqs, ids

    def next(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` sequences ``[n, seq_len]`` and their global sequence ids ``[n]``."""
        seqs, ids = [], []
        while n:
            if self._buffer is None:
                self._fill()
            assert self._buffer is not None and self._buffer_ids is not None
            k = min(n, self.window - self._taken)
            seqs.append(self._buffer[self._taken : self._taken + k])
            ids.append(self._buffer_ids[self._taken : self._taken + k])
            self._taken += k
            n -= k
            if self._taken == self.window:
                _, self._window_start = self._read(self._window_start, self.window * self.seq_len)
                self._window_index += 1
                self._taken, self._buffer, self._buffer_ids = 0, None, None
        return np.concatenate(seqs), np.concatenate(ids)

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": asdict(self._window_start),
            "window_index": self._window_index,
            "taken": self._taken,
            "seq_len": self.seq_len,
            "window": self.window,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seq_len", "window", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data stream: checkpoint has {key}={state[key]!r}, the config "
                    f"gives {getattr(self, key)!r} (the sequence order would change)"
                )
        self._window_start = Cursor(**state["cursor"])
        self._window_index, self._taken = int(state["window_index"]), int(state["taken"])
        self._buffer = self._buffer_ids = None


class RankBatches:
    """This rank's micro-batches of each global batch.

    Args:
        stream: the global ``PackedSequences``.
        global_batch, micro_batch: sequences per optimizer step (all ranks) and per forward pass (one rank).
        rank, world_size: this rank's contiguous slice of each global batch.
        mix: optional ``pipeline.data.mix.RetrievalMix``; whether a sequence gets a task, and which, is decided
            by a generator seeded with the sequence's global id (so the same sequence gets the same task on any
            world size and after a resume).
        answer_weight: loss weight of the tasks' answer tokens (1: no weights are produced).
    """

    def __init__(
        self,
        stream: PackedSequences,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        mix: RetrievalMix | None = None,
        seed: int = 0,
        answer_weight: float = 1.0,
    ) -> None:
        self.stream, self.global_batch, self.micro_batch = stream, global_batch, micro_batch
        self.rank, self.world_size = rank, world_size
        self.mix, self.seed = mix, seed
        self.answer_weight = answer_weight
        self.families: collections.Counter[str] = collections.Counter()
        """Tasks written into this rank's sequences so far in this process, per family."""

    def next_step(self) -> list[torch.Tensor]:
        """The micro-batches ``[micro_batch, seq_len]`` (int64) of this rank for the next optimizer step."""
        return [tokens for tokens, _ in self.next_step_weighted()]

    def next_step_weighted(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The micro-batches with their per-token loss weights ``[micro_batch, seq_len]`` (fp32, aligned with the
        tokens as labels), or ``None`` when every token weighs the same."""
        seqs, ids = self.stream.next(self.global_batch)
        per_rank = self.global_batch // self.world_size
        lo = self.rank * per_rank
        mine, mine_ids = seqs[lo : lo + per_rank].copy(), ids[lo : lo + per_rank]
        weights = np.ones(mine.shape, dtype=np.float32) if self.answer_weight != 1.0 else None
        if self.mix is not None and self.mix.fraction > 0:
            for row, gid in enumerate(mine_ids):
                sample = self.mix.sample_for(mine[row], np.random.default_rng([self.seed, 2, int(gid)]))
                if sample is not None:
                    mine[row] = sample.ids
                    self.families[sample.family] += 1
                    if weights is not None:
                        weights[row, sample.answer] = self.answer_weight
        tokens = torch.from_numpy(mine).split(self.micro_batch)
        if weights is None:
            return [(t, None) for t in tokens]
        return list(zip(tokens, torch.from_numpy(weights).split(self.micro_batch)))

    def state_dict(self) -> dict[str, Any]:
        state = self.stream.state_dict()
        if self.mix is not None:
            state[MIX_STATE_KEY] = self.mix.describe()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        before = state.get(MIX_STATE_KEY)
        now = self.mix.describe() if self.mix is not None else None
        if before != now:
            # The order of the sequences is unchanged; only what the mix writes into them differs from here on.
            log.warning("data.retrieval_mix changed since the checkpoint: %s -> %s, from this step on", before, now)


MIX_STATE_KEY = "retrieval_mix"
"""Where a data state records the retrieval mix's settings (``RetrievalMix.describe``)."""


def eos_id_of(data_path: str) -> int | None:
    """The EOS id recorded by data prep (joined between documents), or None when unknown or remote.

    A directory without any manifest (an MDS dataset written by hand) is accepted with a warning. One with a
    manifest but no matching ``_COMPLETE`` marker, or a data-prep work directory, is an interrupted or altered
    data-prep output: refused.

    Raises:
        data_prep.format.IncompleteDatasetError: manifest.json present, marker missing or not matching; or a
            data-prep temporary directory.
    """
    if is_remote(data_path):
        return None
    root = Path(data_path)
    if fmt.is_prep_temporary(root.resolve()):
        raise fmt.IncompleteDatasetError(
            f"data.path={data_path} is a work directory of an interrupted data-prep run "
            "(no _COMPLETE marker); re-run data prep and use its output directory"
        )
    if not (root / fmt.MANIFEST_FILENAME).is_file() and not (root / fmt.COMPLETE_MARKER).is_file():
        log.warning(
            "no manifest in %s (not written by data prep); documents are packed without an EOS separator", data_path
        )
        return None
    manifest = fmt.read_manifest(data_path)
    return manifest.tokenizer.eos_id if manifest.tokenizer.eos_id >= 0 else None

"""Training data: MDS shards from data prep -> packed ``seq_len`` sequences -> per-rank micro-batches.

Determinism whatever the world size: every rank walks the same *global* token stream (shard order seeded per
epoch, samples in shard order so the pieces of a document stay contiguous, documents joined by the tokenizer's
EOS), cuts it into sequences, shuffles them in windows of ``data.shuffle_window`` sequences, and takes its own
contiguous slice of each global batch. So the set of sequences in global batch ``b`` depends only on the seed,
never on the number of ranks, and the loader state is a few global integers that resume on any world size.
Each rank reads the whole global batch (for the paper config about 1 MB of tokens per step), a negligible
cost next to a training step.

A dataset is untrusted input and is never written to, and reading it writes no copy of it either. ``MDSReader``
reads ``index.json`` and checks it (``data_prep.safe_files``: shard names confined to the split directory, no
pickle column) before any shard file is opened, then loads each shard it needs into memory: a local shard is read
from a regular file only (no symbolic links, FIFOs or devices), decompressed in memory when only the compressed
file exists. Every shard's bytes are checked against the size and hash ``index.json`` records before a sample is
decoded from them (``ShardCorruptError`` names the file), and streaming's own ``decode_sample`` decodes each sample
from the checked bytes. The last ``_KEEP_SHARDS`` shards stay in memory (packing reads shards one after another).
Why in memory: every rank reads the whole global stream, so a per-rank decompressed copy on disk wrote the whole
dataset once per rank and epoch (8 TB per epoch for 8 ranks on a 1 TB dataset).

A remote dataset (``s3://``, ``gs://``, ``https://``...) is downloaded by streaming's downloader, which writes
only to files: each compressed shard is fetched once into a node-local cache directory under ``data.cache_dir``
(mode 0700, one per remote URL, shared by the ranks of a node and kept for later epochs and runs), written under a
temporary name and renamed, and hash-checked again each time it is loaded. ``dataset_fingerprint`` is a content
hash of the split's index (which lists every shard's hash) and the tokenizer; the trainer stores it in each
checkpoint and refuses to resume on other data.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import stat
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from data_prep import format as fmt
from data_prep.dataset_tokenizer import TokenizerFiles, read_tokenizer_files
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
from data_prep.safe_write import move
from data_prep.streaming_compat import ensure_streaming_importable
from model.retrieval import NEEDLE_CHUNK, NEEDLE_EACH, NEEDLE_QUERY

if TYPE_CHECKING:
    from pipeline.data.mix import RetrievalMix
    from pipeline.data.retrieval_tasks import TaskSample

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
    "remote_shard_cache",
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
_KEEP_SHARDS = 3
"""Decoded shards kept in memory: packing reads shards one after another, so the current one and a couple before
it (a shuffle window re-read across a shard boundary) are all it needs. At most ``_KEEP_SHARDS`` times data prep's
``shard_size_bytes`` (64 MiB by default) per reader."""
_REMOTE_CACHE_PREFIX = "gca-remote-"
_DOWNLOAD_TIMEOUT_S = 60


def remote_shard_cache(parent: Path, remote: str) -> Path:
    """The node-local directory under ``parent`` that keeps the downloaded shard files of the split at ``remote``:
    one per URL (named by its hash), shared by this user's readers on the node, created mode 0700 and checked to
    be a real directory of this user only (its files are trusted no further than their recorded hashes).

    Raises:
        UnsafeDatasetError: the directory exists but is a link, another user's, or open to others.
    """
    path = parent / f"{_REMOTE_CACHE_PREFIX}{hashlib.sha256(remote.encode()).hexdigest()[:16]}"
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UnsafeDatasetError(
            f"data cache {path} is not a private directory of this user; set data.cache_dir "
            "to a directory only you can write"
        )
    return path


class MDSReader:
    """Random access to one split of a prepared dataset, each shard checked and decoded in memory (see the module
    docstring).

    Args:
        root: dataset directory or remote URL (``s3://...``, ``gs://...``, ``https://...``).
        split: sub-directory (``train`` / ``val``).
        cache_dir: where a remote dataset's downloaded shards are kept (the system temp dir when None); never
            inside a local ``root``. Nothing is written there for a local dataset.
        validate_hash: hash algorithm checked on every shard file before it is used; by default the fastest one
            data prep recorded. A shard with no recorded hash is read unchecked (warned).

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
        self.remote_cache: Path | None = None
        if self.remote is None:
            if is_within(parent, Path(root)):
                raise UnsafeDatasetError(
                    f"data cache {parent} lies inside the dataset {root}, which is never "
                    "written to; set data.cache_dir (or run_dir) to a directory outside data.path"
                )
            index, self.index_bytes = self._local_index(split)
            self.index_path = str(self.split_dir / INDEX_FILENAME)
        else:
            self.index_path = f"{self.remote}/{INDEX_FILENAME}"
            parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.index_bytes = self._download(INDEX_FILENAME, parent)
            index = parse_index(self.index_bytes, self.index_path)
            self.remote_cache = remote_shard_cache(parent, self.remote)  # only after the index passed its checks
        self.hash_algo = self._pick_hash(index["shards"], validate_hash)
        self.shards = [reader_from_json(str(self.split_dir), None, shard) for shard in index["shards"]]
        for shard in self.shards:
            shard.validate(allow_unsafe_types=False)  # streaming's own pickle check, behind check_index
        self.samples_per_shard = np.asarray([s.samples for s in self.shards], dtype=np.int64)
        named = fmt.index_token_dtype(index["shards"][0]) if index["shards"] else None
        self.token_dtype = np.dtype(named or np.int64)
        """The tokens' dtype as the index records prep's columns (int64 for another layout: it holds any id)."""
        if int(self.samples_per_shard.sum()) == 0:
            raise EmptySplitError(
                f"data split {self.remote or self.split_dir} holds no samples ({len(self.shards)} "
                f"shards listed in {self.index_path}); re-run data prep on more documents (or a "
                "larger val_fraction), point data.path (eval: data=) at another dataset, or for an "
                "empty val split set train.eval_every=0"
            )
        self._loaded: OrderedDict[int, bytes] = OrderedDict()

    def _local_index(self, split: str) -> tuple[dict[str, Any], bytes]:
        try:
            return read_index(self.split_dir)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"data.path: no MDS split at {self.split_dir} (index.json missing); run data prep "
                f"first or fix data.path / data.{split}_split"
            ) from None

    def close(self) -> None:
        """Drop the shards held in memory (the reader stays usable: a later sample loads its shard again)."""
        self._loaded.clear()

    def _download(self, name: str, directory: Path, check: Callable[[bytes], bytes] | None = None) -> bytes:
        """A remote file's bytes, fetched by streaming's downloader into a fresh temporary file of ``directory``.
        With ``check``, the bytes must pass it and the file is then kept as ``directory/name`` (renamed, so no
        reader ever sees a partial file); without, it is deleted."""
        from streaming.base.storage.download import CloudDownloader

        assert self.remote is not None
        fd, tmp_name = tempfile.mkstemp(prefix=".download-", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        url = f"{self.remote}/{name}"
        downloader = CloudDownloader.get(url)
        try:
            downloader.download(url, str(tmp), _DOWNLOAD_TIMEOUT_S)
            data = read_regular(directory, tmp.name)
            if check is not None:
                data = check(data)
                (directory / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                move(tmp, directory / name)
            return data
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
        """The checked bytes of one shard file: read from a regular file of the split, or (remote) from the node's
        cache, downloaded into it the first time."""
        if self.remote is not None:
            return self._fetch_remote(info)
        where = str(self.split_dir / info.basename)
        with os.fdopen(open_regular(self.split_dir, info.basename), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != info.bytes:  # checked before reading: a shard grown to gigabytes is never loaded
                raise ShardCorruptError(
                    f"Size mismatch: {where}: {size} bytes, but {self.index_path} records "
                    f"{info.bytes}; the shard changed since data prep wrote it (re-run data prep)"
                )
            return self._check(info, f.read(), where)

    def _fetch_remote(self, info: Any) -> bytes:
        """A remote shard file from the node's cache when a copy there passes the size and hash check, else
        downloaded (checked, then kept for the next load)."""
        assert self.remote_cache is not None
        where = f"{self.remote}/{info.basename}"
        if stat_regular(self.remote_cache, info.basename) is not None:
            cached = self.remote_cache / info.basename
            try:
                return self._check(info, read_regular(self.remote_cache, info.basename), f"{cached} (copy of {where})")
            except ShardCorruptError as err:  # a copy from another version of the dataset: fetch it again
                log.warning("%s; downloading it again", err)
        return self._download(info.basename, self.remote_cache, lambda data: self._check(info, data, where))

    def _raw_bytes(self, raw: Any, packed: Any, compression: str | None) -> bytes:
        """A shard file's decoded bytes. Locally the raw file is used when present (a dataset read in place by an
        older version holds both), else the compressed one; remotely the compressed one (a smaller download)."""
        from streaming.base.compression import decompress

        local_raw = self.remote is None and stat_regular(self.split_dir, raw.basename) is not None
        if packed is None or local_raw:
            return self._fetch(raw)
        where = f"{self.remote or self.split_dir}/{raw.basename}"
        return self._check(raw, decompress(compression, self._fetch(packed)), f"{where} (decompressed)")

    def shard_bytes(self, shard: int) -> bytes:
        """The checked, decompressed bytes of shard ``shard`` (an MDS shard file), loaded on first use; the least
        recently used shard beyond ``_KEEP_SHARDS`` is dropped."""
        if shard in self._loaded:
            self._loaded.move_to_end(shard)
            return self._loaded[shard]
        data = self._load(shard)
        self._loaded[shard] = data
        while len(self._loaded) > _KEEP_SHARDS:
            self._loaded.popitem(last=False)
        return data

    def _load(self, shard: int) -> bytes:
        """Shard ``shard``'s checked bytes, read now (kept nowhere)."""
        reader = self.shards[shard]
        [(raw, packed)] = reader.file_pairs  # an MDS shard is one data file (raw, and its compressed form)
        data = self._raw_bytes(raw, packed, reader.compression)
        # The header is the sample count and count + 1 offsets; checked here, so a shard with no recorded hash
        # cannot make a sample slice reach outside its bytes.
        where = f"{self.remote or self.split_dir}/{raw.basename}"
        header = 4 * (reader.samples + 2)
        offsets = np.frombuffer(data, np.uint32, count=reader.samples + 2) if len(data) >= header else None
        if (
            offsets is None
            or offsets[0] != reader.samples
            or offsets[1] < header
            or np.any(np.diff(offsets[1:].astype(np.int64)) < 0)
            or offsets[-1] > len(data)
        ):
            raise ShardCorruptError(
                f"{where}: not an MDS shard of {reader.samples} samples (bad header); the shard changed since "
                "data prep wrote it (re-run data prep)"
            )
        return data

    @property
    def shard_sizes(self) -> np.ndarray:
        """Each shard's decoded size in bytes, as ``index.json`` records it (what holding the shard costs)."""
        return np.asarray([s.file_pairs[0][0].bytes for s in self.shards], dtype=np.int64)

    def shard_tokens(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every sample of shard ``shard`` at once: its token ids concatenated (the column's own dtype), each
        sample's token count and each sample's document id. The shard's bytes are read, checked and dropped (not
        kept in the cache of `shard_bytes`): only the tokens stay, one copy."""
        reader = self.shards[shard]
        data = memoryview(self._load(shard))
        offsets = np.frombuffer(data, np.uint32, count=reader.samples + 1, offset=4)
        pieces, docs = [], np.empty(reader.samples, dtype=np.int64)
        for index in range(reader.samples):
            sample = reader.decode_sample(data[offsets[index] : offsets[index + 1]])  # type: ignore[arg-type]  # any buffer
            pieces.append(np.asarray(sample[fmt.TOKENS]))
            docs[index] = int(sample[fmt.DOC_ID])
        lengths = np.asarray([len(piece) for piece in pieces], dtype=np.int64)
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return tokens, lengths, docs

    def sample(self, shard: int, index: int) -> tuple[np.ndarray, int]:
        """Token ids and document id of sample ``index`` of shard ``shard``."""
        reader = self.shards[shard]
        if not 0 <= index < reader.samples:
            raise IndexError(f"sample {index} of shard {shard}, which holds {reader.samples}")
        data = self.shard_bytes(shard)
        begin, end = np.frombuffer(data, np.uint32, count=2, offset=4 * (1 + int(index)))
        sample = reader.decode_sample(data[begin:end])
        return np.asarray(sample[fmt.TOKENS]), int(sample[fmt.DOC_ID])


def read_tokenizer(data_path: str) -> TokenizerFiles | None:
    """The tokenizer next to a local dataset (``tokenizer.model``, or ``tokenizer.json`` with its config), read as
    regular files only (a link or FIFO planted there is refused, never followed or blocked on); None when there is
    none, or the dataset is remote.

    Raises:
        UnsafeDatasetError: a tokenizer file is a link, FIFO, device or directory, or both kinds are there.
    """
    if is_remote(data_path):
        return None
    return read_tokenizer_files(Path(data_path))


def dataset_fingerprint(reader: MDSReader, data_path: str) -> dict[str, str | None]:
    """Content fingerprint of the training data: sha256 of the split's ``index.json`` (which records every
    shard's hash, size and sample count) and of ``tokenizer.model`` / ``tokenizer.json`` (``None`` when there is
    none, or remote)."""
    tokenizer = read_tokenizer(data_path)
    return {
        "index_sha256": hashlib.sha256(reader.index_bytes).hexdigest(),
        "tokenizer_sha256": tokenizer.sha256 if tokenizer is not None else None,
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

    def __init__(self, reader: Any, *, seq_len: int, seed: int, shuffle: bool, window: int, eos_id: int | None) -> None:
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

    token_dtype = np.dtype(np.int64)
    """What `fill` writes: this order widens every token to int64 as it reads."""

    def fill(self, out: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Write the next sequences into rows ``rows`` of ``out`` (``None``: every row, in order); their ids, and
        each one's `epoch` as a call of `next` that ended with it would leave it."""
        n = len(out) if rows is None else len(rows)
        ids, epochs = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            take = min(n - done, self.window - self._taken)
            seqs, ids[done : done + take] = self.next(take)
            out[slice(done, done + take) if rows is None else rows[done : done + take]] = seqs
            epochs[done : done + take] = self.epoch
            done += take
        return ids, epochs

    @property
    def epoch(self) -> int:
        """The epoch the current window starts in."""
        return self._window_start.epoch

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
        if "order" in state:
            raise ValueError(
                f"cannot resume the data stream: the checkpoint was written with data.shuffle_scope={state['order']} "
                "and data.shuffle=true; set them back to resume it"
            )
        for key in ("seq_len", "window", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data stream: checkpoint has {key}={state[key]!r}, the config "
                    f"gives {getattr(self, key)!r} (the sequence order would change)"
                )
        self._window_start = Cursor(**state["cursor"])
        self._window_index, self._taken = int(state["window_index"]), int(state["taken"])
        self._buffer = self._buffer_ids = None


class SequenceStream(Protocol):
    """A global sequence stream: what `RankBatches` reads (one source's stream, or a mixture of them)."""

    @property
    def epoch(self) -> int: ...

    def next(self, n: int) -> tuple[np.ndarray, np.ndarray]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SourceStream(SequenceStream, Protocol):
    """One text source's stream: `PackedSequences` or ``pipeline.data.order.BlockShuffledSequences``, which can
    also write its sequences into given rows of a mixture's global batch."""

    seq_len: int

    @property
    def token_dtype(self) -> np.dtype:
        """The dtype `fill` writes without widening (its tokens' own)."""
        ...

    def fill(self, out: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]: ...


class RankBatches:
    """This rank's micro-batches of each global batch.

    Args:
        stream: the global sequence stream; a ``pipeline.data.mixture.MixtureStream`` also says each sequence's
            source and which sequences carry a retrieval task (``next_labeled``); any other stream is one text
            source without tasks.
        global_batch, micro_batch: sequences per optimizer step (all ranks) and per forward pass (one rank).
        rank, world_size: this rank's contiguous slice of each global batch.
        mix: the ``pipeline.data.mix.RetrievalMix`` that writes the tasks; its random draws come from a generator
            seeded with the sequence's key in its text source (so the same sequence gets the same task on any world
            size and after a resume).
        answer_weight: loss weight of the tasks' answer tokens (1: no weights are produced).
        needle_labels: also mark, per micro-batch, where each task's answer retrieves and its needles are
            (``retrieval_labels``, for the retriever's supervised loss ``model.retrieval.needle_loss``).
        each_needle_chunk: mark every needle chunk as a target of its own (``NEEDLE_EACH``) instead of the
            chunks as one set (``data.retrieval_mix.retriever_loss_each``).
    """

    def __init__(
        self,
        stream: SequenceStream,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        mix: RetrievalMix | None = None,
        seed: int = 0,
        answer_weight: float = 1.0,
        needle_labels: bool = False,
        each_needle_chunk: bool = False,
    ) -> None:
        self.stream, self.global_batch, self.micro_batch = stream, global_batch, micro_batch
        self.rank, self.world_size = rank, world_size
        self.mix, self.seed = mix, seed
        self.answer_weight = answer_weight
        if mix is not None and not hasattr(stream, "next_labeled"):
            raise ValueError(
                "a retrieval mix needs a stream that says which sequences carry a task: "
                "pipeline.data.mixture.with_tasks(stream, fraction)"
            )
        self.families: collections.Counter[str] = collections.Counter()
        """Tasks written into this rank's sequences so far in this process, per family."""
        self.step_sources = np.zeros(0, dtype=np.int64)
        """The source index of each sequence of the last global batch (all ranks'; 0 for a stream of one source)."""
        self.rank_sources = np.zeros(0, dtype=np.int64)
        """The source index of each of this rank's sequences of the last step, in micro-batch order."""
        self.needle_labels = needle_labels
        self.each_needle_chunk = each_needle_chunk
        self.retrieval_labels: list[torch.Tensor] = []
        """With ``needle_labels``: the last step's ``[micro_batch, seq_len // chunk_size]`` int64 marks per
        micro-batch (``model.retrieval.NEEDLE_QUERY`` at the landmarks whose retrievals serve a task's answer,
        ``NEEDLE_CHUNK`` at the chunks of the needles it asks for, 0 elsewhere and on sequences without a task)."""

    @property
    def epoch(self) -> int:
        """The epoch of the training split the last step's sequences came from (0-based)."""
        return self.stream.epoch

    def next_step(self) -> list[torch.Tensor]:
        """The micro-batches ``[micro_batch, seq_len]`` (int64) of this rank for the next optimizer step."""
        return [tokens for tokens, _ in self.next_step_weighted()]

    def _draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The next global batch: sequences, task keys, sources and task flags."""
        labeled = getattr(self.stream, "next_labeled", None)
        if labeled is not None:
            draw = labeled(self.global_batch)
            return draw.sequences, draw.keys, draw.sources, draw.tasks
        seqs, ids = self.stream.next(self.global_batch)
        none = np.zeros(len(ids), dtype=np.int64)
        return seqs, ids, none, none.astype(bool)

    def next_step_weighted(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The micro-batches with their per-token loss weights ``[micro_batch, seq_len]`` (fp32, aligned with the
        tokens as labels), or ``None`` when every token weighs the same."""
        seqs, keys, sources, tasks = self._draw()
        per_rank = self.global_batch // self.world_size
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        rows, row_keys = seqs[mine].astype(np.int64), keys[mine]  # a copy the tasks write into, widened for torch
        self.step_sources, self.rank_sources = sources, sources[mine]
        weights = np.ones(rows.shape, dtype=np.float32) if self.answer_weight != 1.0 else None
        labels = None
        if self.needle_labels and self.mix is not None:
            labels = np.zeros((len(rows), rows.shape[1] // self.mix.chunk_size), dtype=np.int64)
        for row in np.flatnonzero(tasks[mine]):
            if self.mix is None:
                raise ValueError("the stream asks for a retrieval task but no retrieval mix was given")
            sample = self.mix.task_for(rows[row], np.random.default_rng([self.seed, 2, int(row_keys[row])]))
            rows[row] = sample.ids
            self.families[sample.family] += 1
            if weights is not None:
                weights[row, sample.answer] = self.answer_weight
            if labels is not None:
                mark_needles(labels[row], sample, self.mix.chunk_size, each=self.each_needle_chunk)
        self.retrieval_labels = [] if labels is None else list(torch.from_numpy(labels).split(self.micro_batch))
        tokens = torch.from_numpy(rows).split(self.micro_batch)
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
            # The text of the sequences is unchanged; only which carry a task, and which, differs from here on.
            log.warning("data.retrieval_mix changed since the checkpoint: %s -> %s, from this step on", before, now)


def mark_needles(labels: np.ndarray, sample: TaskSample, chunk_size: int, *, each: bool = False) -> None:
    """Write ``sample``'s retrieval label into its row ``labels [C]``: every landmark whose retrieval serves its
    answer (``TaskSample.answer_rows``, the question's first) and, as targets, the asked needles' chunks (each a
    target of its own with ``each``, else one set)."""
    for row in sample.answer_rows(chunk_size):
        if 0 <= row < len(labels):
            labels[row] = NEEDLE_QUERY
    for chunk in sample.asked_chunks:
        if chunk < len(labels):
            labels[chunk] = NEEDLE_EACH if each else NEEDLE_CHUNK


MIX_STATE_KEY = "retrieval_mix"
"""Where a data state records the retrieval mix's settings (``RetrievalMix.describe``)."""


def refuse_prep_work_dir(data_path: str) -> None:
    """Raise `data_prep.format.IncompleteDatasetError` when ``data_path`` is the work directory of a data-prep run
    (an interrupted one: a finished run renames it to its output)."""
    if fmt.is_prep_temporary(Path(data_path).resolve()):
        raise fmt.IncompleteDatasetError(
            f"data.path={data_path} is a work directory of an interrupted data-prep run "
            "(no _COMPLETE marker); re-run data prep and use its output directory"
        )


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
    refuse_prep_work_dir(data_path)
    root = Path(data_path)
    if not (root / fmt.MANIFEST_FILENAME).is_file() and not (root / fmt.COMPLETE_MARKER).is_file():
        log.warning(
            "no manifest in %s (not written by data prep); documents are packed without an EOS separator", data_path
        )
        return None
    manifest = fmt.read_manifest(data_path)
    return manifest.tokenizer.eos_id if manifest.tokenizer.eos_id >= 0 else None

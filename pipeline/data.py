"""Training data: MDS shards from data prep -> packed ``seq_len`` sequences -> per-rank micro-batches.

Determinism whatever the world size: every rank walks the same *global* token stream (shard order seeded per
epoch, samples in shard order so the pieces of a document stay contiguous, documents joined by the tokenizer's
EOS), cuts it into sequences, shuffles them in windows of ``data.shuffle_window`` sequences, and takes its own
contiguous slice of each global batch. So the set of sequences in global batch ``b`` depends only on the seed,
never on the number of ranks, and the loader state is a few global integers that resume on any world size.
Each rank reads the whole global batch (for the paper config about 1 MB of tokens per step), a negligible
cost next to a training step.

The ``StreamingDataset`` is used only as a random-access reader (local directory or remote URL, with its shard
cache); its own rank partitioning is not used, for the reason above.

Untrusted input is checked before use. ``index.json`` is read and validated before ``StreamingDataset`` sees
it: a shard path that could leave the split directory (``../x``, ``/x``) raises ``UnsafeShardPathError`` before
any shard file is opened or created, and a pickle column raises ``UnsafeColumnError`` (pickle runs code). Each
shard's file is hashed against ``index.json`` the first time this process reads it, whether it was just
extracted or left by an earlier run (``ShardCorruptError`` names the file). ``dataset_fingerprint`` is a content
hash of the split's index (which lists every shard's hash) and the tokenizer; the trainer stores it in each
checkpoint and refuses to resume on other data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from data_prep import format as fmt
from data_prep.streaming_compat import ensure_streaming_importable

log = logging.getLogger(__name__)


def is_remote(path: str) -> bool:
    return "://" in path


class UnsafeDatasetError(ValueError):
    """A dataset index asks for something this reader refuses to do."""


class UnsafeShardPathError(UnsafeDatasetError):
    """A shard file name in ``index.json`` is not a plain relative path inside the split directory."""


class UnsafeColumnError(UnsafeDatasetError):
    """A column uses an encoding that runs code when decoded (pickle)."""


class ShardCorruptError(ValueError):
    """A shard file's hash differs from the one ``index.json`` recorded at write time."""


class DataFingerprintError(ValueError):
    """The dataset differs from the one the checkpoint was trained on."""


_SAFE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_UNSAFE_ENCODINGS = ("pkl",)
_HASH_PREFERENCE = ("xxh3_64", "xxh64", "xxh128", "xxh3_128", "sha256", "sha1", "md5")
"""Order in which a shard hash is picked when ``data.validate_hash`` is unset: fastest first."""


def check_shard_path(name: object, where: str) -> str:
    """``name`` if it is a relative POSIX path of plain parts (letters, digits, ``_ . -``; no ``..``, no leading
    ``.``, no ``/`` at the start, no backslash) -- so it cannot leave the split directory -- else raise.

    Raises:
        UnsafeShardPathError: naming ``where`` and the offending name.
    """
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name != "/".join(parts) or not all(_SAFE_PART.fullmatch(p) for p in parts):
        raise UnsafeShardPathError(f"{where}: shard file name {name!r} is not a plain relative path inside the "
                                   "split directory (path traversal?); refusing the dataset before opening any shard")
    return str(name)


def check_index(index: Any, where: str) -> None:
    """Validate an MDS ``index.json`` object before any shard is touched: every shard file name is a safe
    relative path (`check_shard_path`) and no column uses an unsafe (pickle) encoding."""
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise UnsafeDatasetError(f"{where}: not an MDS index (no 'shards' list)")
    for i, shard in enumerate(index["shards"]):
        if not isinstance(shard, dict):
            raise UnsafeDatasetError(f"{where}: shard {i} is not an object")
        for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
            info = shard.get(key)
            if info is not None:
                check_shard_path(info.get("basename") if isinstance(info, dict) else info, f"{where}: shard {i} {key}")
        for name, encoding in zip(shard.get("column_names", []), shard.get("column_encodings", [])):
            if str(encoding).split(":")[0] in _UNSAFE_ENCODINGS:
                raise UnsafeColumnError(f"{where}: shard {i} column {name!r} has encoding {encoding!r}, which "
                                        "unpickles (runs code) on read; the trainer never reads such columns")


def _hash_file(algo: str, path: str) -> str:
    from streaming.base.hashing import get_hash

    with open(path, "rb") as f:
        return get_hash(algo, f.read())


class MDSReader:
    """Random access to one split of a prepared dataset, through ``streaming.StreamingDataset``.

    Args:
        root: dataset directory or remote URL (``s3://...``, ``gs://...``, ``https://...``).
        split: sub-directory (``train`` / ``val``).
        cache_dir: local shard cache for a remote root (ignored for a local one, which is read in place).
        validate_hash: hash algorithm checked on every shard file before its first read in this process; by
            default the fastest one data prep recorded. A shard with no recorded hash is read unchecked (warned).
    """

    def __init__(self, root: str, split: str, cache_dir: str | None, validate_hash: str | None = None) -> None:
        ensure_streaming_importable()
        from streaming import StreamingDataset

        if is_remote(root):
            remote: str | None = root.rstrip("/") + "/" + split
            cache_root = Path(cache_dir or "data_cache")
            local = str(cache_root / hashlib.sha256(remote.encode()).hexdigest()[:16] / split)
            self.index_path = self._fetch_index(str(remote), local)
        else:
            remote, local = None, str(Path(root) / split)
            self.index_path = Path(local) / "index.json"
            if not self.index_path.is_file():
                raise FileNotFoundError(f"data.path: no MDS split at {local} (index.json missing); run data prep "
                                        f"first or fix data.path / data.{split}_split")
        self.local = local
        index = json.loads(self.index_path.read_text())
        check_index(index, str(self.index_path))  # before StreamingDataset opens, creates or deletes any file
        self.hash_algo = self._pick_hash(index["shards"], validate_hash)
        self.dataset = StreamingDataset(remote=remote, local=local, shuffle=False, batch_size=1,
                                        validate_hash=self.hash_algo, allow_unsafe_types=False)
        self.samples_per_shard = np.asarray(self.dataset.samples_per_shard, dtype=np.int64)
        self.shard_offsets = np.asarray(self.dataset.sample_offset_per_shard, dtype=np.int64)
        if int(self.samples_per_shard.sum()) == 0:
            raise ValueError(f"data split {root}/{split} holds no samples")
        self._verified: set[int] = set()

    @staticmethod
    def _fetch_index(remote: str, local: str) -> Path:
        """Download a remote split's index.json into the cache (once), so it is validated before streaming uses it."""
        path = Path(local) / "index.json"
        if not path.is_file():
            from streaming.base.storage.download import CloudDownloader

            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"index.json.tmp-{os.getpid()}")
            CloudDownloader.get(remote).download(remote + "/index.json", str(tmp), 60)
            os.replace(tmp, path)
        return path

    def _pick_hash(self, shards: list[dict], requested: str | None) -> str | None:
        def recorded(shard: dict) -> set[str]:
            infos = [shard.get(k) for k in ("raw_data", "zip_data") if shard.get(k)]
            return set.intersection(*(set(i.get("hashes", {})) for i in infos)) if infos else set()

        common = set.intersection(*(recorded(s) for s in shards)) if shards else set()
        if requested is not None:
            if shards and requested not in common:
                raise ValueError(f"data.validate_hash={requested!r}, but {self.index_path} records only "
                                 f"{sorted(common) or 'no hashes'} for every shard")
            return requested
        algo = next((a for a in _HASH_PREFERENCE if a in common), None)
        if algo is None and shards:
            log.warning("%s records no shard hash common to all shards; corrupt shards cannot be detected",
                        self.index_path)
        return algo

    @property
    def num_shards(self) -> int:
        return len(self.samples_per_shard)

    def _verify(self, shard: int) -> None:
        """Extract/download the shard if needed (streaming checks the archive's hash), then hash the file that
        will be read, so a shard damaged since an earlier run is caught too."""
        self.dataset.prepare_shard(shard)
        if self.hash_algo is not None:
            for raw, _ in self.dataset.shards[shard].file_pairs:
                path = os.path.join(self.local, raw.basename)
                actual, expected = _hash_file(self.hash_algo, path), raw.hashes[self.hash_algo]
                if actual != expected:
                    raise ShardCorruptError(
                        f"Checksum failure: {path}: {self.hash_algo} {actual}, but {self.index_path} records "
                        f"{expected}; the shard changed since data prep wrote it (delete it to re-extract or "
                        "re-download it, or re-run data prep)")
        self._verified.add(shard)

    def sample(self, shard: int, index: int) -> tuple[np.ndarray, int]:
        """Token ids and document id of sample ``index`` of shard ``shard``."""
        if shard not in self._verified:
            self._verify(shard)
        sample = self.dataset.get_item(int(self.shard_offsets[shard] + index))
        return np.asarray(sample[fmt.TOKENS]), int(sample[fmt.DOC_ID])


def dataset_fingerprint(reader: MDSReader, data_path: str) -> dict[str, str | None]:
    """Content fingerprint of the training data: sha256 of the split's ``index.json`` (which records every
    shard's hash, size and sample count) and of ``tokenizer.model`` (``None`` when there is none, or remote)."""
    tokenizer = Path(data_path) / fmt.TOKENIZER_FILENAME
    has_tokenizer = not is_remote(data_path) and tokenizer.is_file()
    return {"index_sha256": hashlib.sha256(reader.index_path.read_bytes()).hexdigest(),
            "tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest() if has_tokenizer else None}


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise `DataFingerprintError` naming each component that differs (old vs new hash)."""
    changed = [f"{key}: checkpoint {saved.get(key)} vs now {current.get(key)}" for key in sorted(current)
               if saved.get(key) != current.get(key)]
    if changed:
        raise DataFingerprintError(
            f"dataset fingerprint mismatch: {where} was trained on other data than data.path now holds ("
            + "; ".join(changed) + "); the data order and token ids would silently change. Point data.path at the "
            "original dataset, or start a new run (checkpoint.resume=none)")


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

    def __init__(self, reader: Any, seq_len: int, seed: int, shuffle: bool, window: int, eos_id: int | None) -> None:
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
        return {"cursor": asdict(self._window_start), "window_index": self._window_index, "taken": self._taken,
                "seq_len": self.seq_len, "window": self.window, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seq_len", "window", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the data stream: checkpoint has {key}={state[key]!r}, the config "
                                 f"gives {getattr(self, key)!r} (the sequence order would change)")
        self._window_start = Cursor(**state["cursor"])
        self._window_index, self._taken = int(state["window_index"]), int(state["taken"])
        self._buffer = self._buffer_ids = None


class RankBatches:
    """This rank's micro-batches of each global batch.

    Args:
        stream: the global ``PackedSequences``.
        global_batch, micro_batch: sequences per optimizer step (all ranks) and per forward pass (one rank).
        rank, world_size: this rank's contiguous slice of each global batch.
        needles: optional ``NeedleInserter``; applied to a sequence with probability ``needle_mix``, decided by
            a generator seeded with the sequence's global id (so the same sequence gets the same needle on any
            world size and after a resume).
        answer_weight: loss weight of the needle answers' tokens (1: no weights are produced).
    """

    def __init__(self, stream: PackedSequences, global_batch: int, micro_batch: int, rank: int, world_size: int,
                 needles: Any = None, needle_mix: float = 0.0, seed: int = 0, answer_weight: float = 1.0) -> None:
        self.stream, self.global_batch, self.micro_batch = stream, global_batch, micro_batch
        self.rank, self.world_size = rank, world_size
        self.needles, self.needle_mix, self.seed = needles, needle_mix, seed
        self.answer_weight = answer_weight

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
        if self.needles is not None and self.needle_mix > 0:
            for row, gid in enumerate(mine_ids):
                rng = np.random.default_rng([self.seed, 2, int(gid)])
                if rng.random() < self.needle_mix:
                    mine[row], answer = self.needles.insert(mine[row], rng)
                    if weights is not None:
                        weights[row, answer] = self.answer_weight
        tokens = torch.from_numpy(mine).split(self.micro_batch)
        if weights is None:
            return [(t, None) for t in tokens]
        return list(zip(tokens, torch.from_numpy(weights).split(self.micro_batch)))

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


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
        raise fmt.IncompleteDatasetError(f"data.path={data_path} is a work directory of an interrupted data-prep run "
                                         "(no _COMPLETE marker); re-run data prep and use its output directory")
    if not (root / fmt.MANIFEST_FILENAME).is_file() and not (root / fmt.COMPLETE_MARKER).is_file():
        log.warning("no manifest in %s (not written by data prep); documents are packed without an EOS separator",
                    data_path)
        return None
    manifest = fmt.read_manifest(data_path)
    return manifest.tokenizer.eos_id if manifest.tokenizer.eos_id >= 0 else None

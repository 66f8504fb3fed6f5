"""Checkpoints: ``<run_dir>/checkpoints/step_NNNNNNNN/``, verified by a sha256 manifest, committed by a marker.

A save goes into ``step_N.tmp/`` (engine-native state, per-rank RNG, trainer state, optional eval export). Then
every file is hashed (each rank hashes a share; the files are fsynced on the way) into ``integrity.json``;
rank 0 renames the directory to ``step_N/`` and writes ``COMMITTED`` inside, last. Only directories with that
marker are ever resumed from, so a crash at any point of a save leaves the previous checkpoint in charge, and
leftovers of interrupted saves are deleted at the next start. After a commit the oldest committed checkpoints
beyond ``checkpoint.keep_last`` are deleted (marker first); a deletion that fails is a warning, never an error.

Deletion is limited to what this trainer provably wrote: the first file of every save is ``OWNER.json``
(written before anything else, naming the run and the step), and only directories holding a matching one (or
empty ones) are ever removed, whether as a leftover or by ``keep_last``. Anything else under ``checkpoints/``
is left alone: an uncommitted foreign ``step_*`` entry stops the run before any work (`foreign_leftovers`), a
foreign committed checkpoint may be resumed from but is never pruned, and symbolic links are never followed.

Loading checks, in order and before any tensor reaches the model: the marker; the integrity manifest (every
file present, no file added, sha256 equal: ``CheckpointCorruptError`` names the file); the trainer state, every
field of it (type and range, and a ``step`` equal to the directory's: `read_trainer_state`), its format and
architecture; the parallel layout (engine, ZeRO stage, and whether the world size may change); and that no
pickle in the directory can run code (``UnsafeCheckpointError``). Torch files are only ever read with
``weights_only=True``; DeepSpeed and DCP unpickle with ``weights_only=False`` internally, so their files are
scanned first with the restricted unpicklers below. A committed checkpoint that fails the integrity check or the
scan, or whose manifest or trainer state does not have the shape a save writes (a file edited and the manifest
resealed; every JSON file read back goes through ``data_prep.json_file``), is never loaded; by default
(``checkpoint.fallback_to_previous``) it is renamed to ``step_N.rejected`` and the newest one that passes is
resumed from. It is never deleted: the files that would prove it ours are among those that failed.

Cost: each file is read once more at save and once at resume to hash it, the work split over the ranks; the
pickle scan reads only pickles (tensor data is memory-mapped, not read). Like DeepSpeed and DCP, this assumes
the checkpoint directory is on a filesystem every rank sees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args, get_type_hints

import torch

from data_prep.json_file import Fields, JsonFileError, read_json, summarize
from data_prep.redaction import redact
from data_prep.safe_write import move, replacing, write_text
from model.config import BACKEND_FIELDS
from pipeline.data.mixture import MIXTURE_STATE_KEY
from pipeline.data.order import ORDER as BLOCK_ORDER
from pipeline.data.reader import Cursor
from pipeline.train import dist, save_failure
from pipeline.train.config import ParallelConfig

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
OWNER_FILE = "OWNER.json"
_STEP_NAME = re.compile(r"step_\d+(\.tmp)?")
_COMMITTED_NAME = re.compile(r"step_\d+")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
OWNER_WRITER = "gca-pretrain trainer"
"""``OWNER.json``'s ``writer``: with a ``step`` equal to the directory's, proof that a save of this trainer made it."""
TRAINER_STATE = "trainer_state.json"
INTEGRITY_FILE = "integrity.json"
STATE_FORMAT = 2
"""1: the first release (no integrity manifest, no parallel layout, no data fingerprint). 2: this one."""
MAX_STEP = 10**12
"""The largest ``step`` a trainer state may hold: far past any run (a million steps is a long pretraining run), and
exact in the float arithmetic of the schedule."""
MAX_WORLD_SIZE = 1 << 20
"""The largest ``world_size`` a trainer state may record: a million ranks, past any cluster."""
_INT64_MAX = (1 << 63) - 1
"""Counters and data positions end up in int64 tensors and metrics; a larger one was not written by a save."""
_MAX_NAME_CHARS = 1024
"""Longer than any path a save writes inside its directory; a longer name in a manifest was not written by one."""
_OWNER_MAX_BYTES = 1 << 16
"""``OWNER.json`` holds three short fields; read at every prune, so a large one is refused unread."""
ENGINES = get_args(get_type_hints(ParallelConfig)["engine"])
SAVE_POINTS = ("engine", "rng", "export", "trainer_state", "manifest", "renamed")
"""Points inside ``CheckpointManager.save``, in order: after the engine state, the per-rank RNG files, the eval
export, ``trainer_state.json``, the integrity manifest, and after the rename to ``step_N/`` (before the marker).
A ``save_point`` listener hears each one (the reliability tests' faults fire there)."""

_MIN_TORCH = (2, 10)
# weights_only=True had remote-code-execution bypasses before 2.10 (CVE-2025-32434 <= 2.5.1, CVE-2026-24747 < 2.10).
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < _MIN_TORCH:
    raise ImportError(
        f"torch {torch.__version__} is too old: loading checkpoints safely needs torch >= 2.10 "
        "(weights_only=True bypasses CVE-2025-32434, CVE-2026-24747)"
    )


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run (missing marker, different architecture, ...)."""


class CheckpointCorruptError(CheckpointError):
    """A file of a checkpoint is missing, added, truncated or changed since the save (integrity manifest)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickle that would import or call something outside the allowlist."""


# -- integrity manifest ---------------------------------------------------------------------------------------


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (relative POSIX paths, sorted), except the marker and the manifest itself.
    Symbolic links are listed too (and then fail verification: a checkpoint never contains one)."""
    names = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_symlink() or p.is_file())
    return sorted(n for n in names if n not in (COMMIT_MARKER, INTEGRITY_FILE))


def _sha256(path: Path, fsync: bool = False) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def _hash_share(root: Path, names: list[str], info: dist.DistInfo, fsync: bool) -> dict[str, dict[str, Any]]:
    """Hash this rank's share of ``names`` (every world_size-th file), then gather every rank's results."""
    mine = {}
    for name in names[info.rank :: info.world_size]:
        digest, size = _sha256(root / name, fsync)
        mine[name] = {"sha256": digest, "bytes": size}
    merged: dict[str, dict[str, Any]] = {}
    for part in dist.all_gather_object(mine):
        merged.update(part)
    return merged


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_integrity(root: Path, info: dist.DistInfo) -> None:
    """Hash (and fsync) every file of ``root`` and write ``integrity.json`` (collective; rank 0 writes)."""
    names = dist.broadcast_object(_files(root) if info.is_main else None)
    files = _hash_share(root, names, info, fsync=True)
    if info.is_main:
        record = {"format": 1, "algorithm": "sha256", "files": files}
        write_text(root / INTEGRITY_FILE, json.dumps(record, indent=1, sort_keys=True), fsync=True)


def _check_digest(fields: Fields, key: str, *, nullable: bool = False) -> None:
    """``fields[key]`` is a sha256 hex digest (or null when ``nullable``); a message about one stays short."""
    value = None if nullable and fields.obj.get(key, "") is None else fields.string(key)
    if value is not None and not _SHA256_HEX.fullmatch(value):
        raise JsonFileError(
            f"{fields.where}: field '{fields.prefix}{key}' is {len(value)} characters, expected 64 hex digits"
        )


def read_manifest(root: Path) -> dict[str, dict[str, Any]]:
    """``root``'s integrity manifest: file name -> ``{"sha256", "bytes"}``, in the shape `write_integrity` writes.

    Raises:
        FileNotFoundError: there is none.
        JsonFileError: unreadable or of another shape; one line naming the field.
    """
    path = root / INTEGRITY_FILE
    fields = Fields(read_json(path), str(path))
    fields.integer("format", low=1, high=1)
    fields.string("algorithm", choices=("sha256",))
    files = fields.nested("files")
    for name in files.obj:
        if len(name) > _MAX_NAME_CHARS:
            raise JsonFileError(f"{path}: field 'files' names a file of {len(name):,} characters")
        entry = files.nested(name)
        entry.integer("bytes", low=0, high=_INT64_MAX)
        _check_digest(entry, "sha256")
    return files.obj


def _listing_problems(root: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Rank 0: the manifest's entries, and what is wrong before any hashing: the manifest itself, files missing,
    added, or symbolic links."""
    try:
        expected = read_manifest(root)
    except FileNotFoundError:
        return {}, [f"missing integrity manifest {root / INTEGRITY_FILE}; the checkpoint cannot be verified"]
    except (OSError, JsonFileError) as err:
        return {}, [f"unreadable integrity manifest ({err})"]
    actual = set(_files(root))
    problems = [f"{root / n}: listed in {INTEGRITY_FILE} but missing" for n in sorted(set(expected) - actual)]
    problems += [
        f"{root / n}: not listed in {INTEGRITY_FILE} (added after the save)" for n in sorted(actual - set(expected))
    ]
    problems += [f"{root / n}: is a symbolic link" for n in sorted(actual) if (root / n).is_symlink()]
    return expected, problems


def _content_problems(root: Path, expected: dict[str, dict[str, Any]], info: dist.DistInfo) -> list[str]:
    """Each listed file whose size or sha256 differs from the manifest (collective: each rank hashes a share)."""
    names = sorted(expected)
    got = _hash_share(root, names, info, fsync=False)
    problems = []
    for name in names:
        want, have = expected[name], got[name]
        if have["bytes"] != want["bytes"]:
            problems.append(
                f"{root / name}: size {have['bytes']} bytes, expected {want['bytes']} (truncated or "
                f"extended); sha256 {have['sha256']}, expected {want['sha256']}"
            )
        elif have["sha256"] != want["sha256"]:
            problems.append(f"{root / name}: sha256 {have['sha256']}, expected {want['sha256']}")
    return problems


def verify_integrity(root: Path, info: dist.DistInfo) -> None:
    """Check ``root`` against its ``integrity.json`` (collective: each rank hashes a share).

    Rank 0 reads the manifest and every rank takes its copy, so that all of them hash the same list or none.

    Raises:
        CheckpointCorruptError: manifest missing, unreadable or of another shape (`read_manifest`), a file missing,
            added, or with another size or sha256; one line naming the first ten files and how many more.
    """
    expected, problems = dist.broadcast_object(_listing_problems(root) if info.is_main else None)
    if not problems:
        problems = _content_problems(root, expected, info)
    if problems:
        raise CheckpointCorruptError(f"checkpoint {root} failed verification: {summarize(problems)}")


# -- refusing pickles that can run code ---------------------------------------------------------------------------

_DCP_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}
"""What a DCP ``.metadata`` pickle may reference: DCP's own metadata dataclasses and plain values."""
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
"""Files that engines (our torch engine, DeepSpeed) or the RNG restore read with ``torch.load``."""


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only an allowlist of globals (plus torch dtypes); anything else is refused before it is imported."""

    def __init__(self, file: Any, allowed: set[tuple[str, str]], where: Path) -> None:
        super().__init__(file)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.allowed or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where}: refusing to unpickle global {module}.{name} (not in the "
            "allowlist of checkpoint metadata types; the file may be crafted to run code)"
        )


def _deepspeed_globals() -> list[Any]:
    """Classes a DeepSpeed ZeRO checkpoint pickles besides tensors (checked on 0.19.8, ZeRO 0-3, fp32 and bf16)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _reason(err: Exception) -> str:
    """The informative line of a weights-only unpickling error (the global or opcode it refused)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    specific = [line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")]
    return (specific or lines or [""])[0]


def _torch_load_checked(path: Path, allowed: list[Any]) -> None:
    """``torch.load(weights_only=True)`` the file (tensors memory-mapped, not read); refuse on any unsafe global."""
    try:
        with torch.serialization.safe_globals(allowed):
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: {_reason(err)} (weights_only=True; the file may be crafted to run code)"
        ) from None
    except (RuntimeError, ValueError, EOFError, OSError) as err:
        raise CheckpointCorruptError(f"{path}: not a readable torch file: {str(err).splitlines()[0]}") from None


def _scan_dcp(metadata_path: Path) -> None:
    """Refuse a DCP checkpoint whose ``.metadata`` or non-tensor items could run code when DCP unpickles them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(metadata_path, "rb") as f:
        metadata = _RestrictedUnpickler(f, _DCP_METADATA_GLOBALS, metadata_path).load()
    byte_items = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_items:
            continue  # tensors: DCP itself reads them with weights_only=True
        if info.transform_descriptors:
            raise UnsafeCheckpointError(
                f"{metadata_path}: item {index.fqn} uses storage transforms "
                f"{info.transform_descriptors}, which this loader does not accept"
            )
        item_path = (metadata_path.parent / info.relative_path).resolve()
        if metadata_path.parent.resolve() not in item_path.parents:
            raise UnsafeCheckpointError(
                f"{metadata_path}: item {index.fqn} points outside the checkpoint ({info.relative_path})"
            )
        with open(item_path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        try:
            torch.load(blob, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"{item_path}: item {index.fqn} refused: {_reason(err)}") from None


def scan_pickles(root: Path) -> None:
    """Prove that loading ``root`` runs no code from the checkpoint: every torch file (`TORCH_SUFFIXES`) loads
    with ``weights_only=True`` (DeepSpeed's few config classes allowlisted), every DCP ``.metadata`` and its
    non-tensor items with the restricted unpickler. No load path unpickles any other file (JSON, safetensors,
    the tokenizer; DCP tensor data is read with ``weights_only=True`` by DCP itself).

    Raises:
        UnsafeCheckpointError: naming the file and the refused global.
    """
    allowed = _deepspeed_globals() if (root / "deepspeed").is_dir() else []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name == ".metadata":
            _scan_dcp(path)
        elif path.suffix in TORCH_SUFFIXES:
            _torch_load_checked(path, allowed)


# -- the manager ----------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def _is_owned(path: Path) -> bool:
    """Whether ``path`` is a real directory whose ``OWNER.json`` says a save of this trainer, for its step, made it."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        owner = Fields(read_json(path / OWNER_FILE, max_bytes=_OWNER_MAX_BYTES), str(path / OWNER_FILE))
        return owner.string("writer") == OWNER_WRITER and owner.integer("step") == _step_of(path)
    except (OSError, JsonFileError):
        return False


def _format_of(state_path: Path) -> int | None:
    """The format a trainer state names, or None when it names none (verification then names the damage)."""
    try:
        return int(Fields(read_json(state_path), str(state_path)).integer("format"))
    except (OSError, JsonFileError):
        return None


def _check_data_position(data: Fields) -> None:
    """The data position (``pipeline.data.mixture.MixtureStream.state_dict``): for one text source its stream's
    position plus ``mixture_consumed`` (absent before mixtures); for several, the ``mixture`` record with each
    source's position at global sequence ``streams_at`` (at or before ``consumed``, the position itself). The
    readers take them without checks."""
    if MIXTURE_STATE_KEY not in data.obj:
        data.integer("mixture_consumed", low=0, high=_INT64_MAX, default=0)
        _check_stream_position(data)
        return
    mixture = data.nested(MIXTURE_STATE_KEY)
    consumed = mixture.integer("consumed", low=0, high=_INT64_MAX)
    mixture.integer("streams_at", low=0, high=consumed, default=consumed)  # absent: written before read-ahead
    for label, definition in mixture.mapping("sources").items():
        if not isinstance(definition, dict):
            raise JsonFileError(f"{data.where}: field 'data.mixture.sources.{label}' is not an object")
    for number, phase in enumerate(mixture.sequence("phases")):
        fields = Fields(phase, data.where, f"data.mixture.phases[{number}].")
        fields.integer("start", low=0, high=_INT64_MAX)
        for label, weight in fields.mapping("weights").items():
            if not isinstance(weight, str) or not _FRACTION.fullmatch(weight):
                raise JsonFileError(f"{data.where}: field 'data.mixture.phases[{number}].weights.{label}' is not p/q")
    streams = mixture.nested("streams")
    for label in streams.obj:
        _check_stream_position(streams.nested(label))


_FRACTION = re.compile(r"[0-9]{1,20}(/[1-9][0-9]{0,19})?")


def _check_stream_position(data: Fields) -> None:
    """One text source's position (``BlockShuffledSequences.state_dict``, or ``PackedSequences.state_dict`` with
    no ``order``)."""
    if "order" in data.obj:
        data.string("order", choices=(BLOCK_ORDER,))
        for name in ("epoch", "block", "taken", "consumed", "emitted_this_epoch"):
            data.integer(name, low=0, high=_INT64_MAX)
        data.integer("seq_len", low=1, high=_INT64_MAX)
        data.integer("block_mib", low=1, high=_INT64_MAX)
        data.integer("seed")
        data.boolean("shuffle")
        return
    cursor = data.nested("cursor")
    names = [field.name for field in dataclasses.fields(Cursor)]
    if sorted(cursor.obj) != sorted(names):
        raise JsonFileError(f"{data.where}: field 'data.cursor' does not hold exactly the keys {', '.join(names)}")
    for name in names:
        cursor.integer(name, low=0, high=_INT64_MAX)
    window = data.integer("window", low=1, high=_INT64_MAX)
    data.integer("taken", low=0, high=window - 1)
    data.integer("window_index", low=0, high=_INT64_MAX)
    data.integer("seq_len", low=1, high=_INT64_MAX)
    data.integer("seed")
    data.boolean("shuffle")


def _check_state(state: Fields, path: Path) -> None:
    """Every field a resume reads back: what `CheckpointManager.save` and ``Trainer.save`` write."""
    step = state.integer("step", low=0, high=MAX_STEP)
    if _COMMITTED_NAME.fullmatch(path.name) and step != _step_of(path):
        raise JsonFileError(f"{state.where}: field 'step' is {step}, but the checkpoint's directory is {path.name}")
    state.integer("world_size", low=1, high=MAX_WORLD_SIZE)
    state.integer("tokens_seen", low=0, high=_INT64_MAX)
    state.mapping("model_config")
    state.string("config_yaml")
    parallel = state.nested("parallel")
    parallel.string("engine", choices=ENGINES)
    parallel.integer("zero_stage", low=0, high=3)
    fingerprint = state.nested("data_fingerprint")
    _check_digest(fingerprint, "index_sha256")
    _check_digest(fingerprint, "tokenizer_sha256", nullable=True)
    _check_data_position(state.nested("data"))


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of the checkpoint ``path``, every field checked (`_check_state`) before any is used.

    A state that fails was edited after the save (with the manifest resealed, or the check would have named it):
    to the resume it is a damaged checkpoint, set aside like one.

    Raises:
        CheckpointCorruptError: unreadable, or a field of another type or out of range; one line naming the file
            and the field.
        CheckpointError: another format version.
    """
    where = path / TRAINER_STATE
    try:
        state = Fields(read_json(where), str(where))
        fmt = state.integer("format")
        if fmt != STATE_FORMAT:
            raise CheckpointError(f"{path}: trainer state format {fmt} is not {STATE_FORMAT}")
        _check_state(state, path)
    except (OSError, JsonFileError) as err:
        raise CheckpointCorruptError(f"unusable trainer state: {err}") from None
    return state.obj


def _is_empty_dir(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir() and not any(path.iterdir())


def _step_entries(root: Path) -> list[Path]:
    """Entries of ``root`` named like a save of this trainer: ``step_<digits>`` or ``step_<digits>.tmp``."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_NAME.fullmatch(p.name))


def _is_committed(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(".tmp") and (path / COMMIT_MARKER).is_file()


def foreign_leftovers(run_dir: str | Path) -> list[Path]:
    """Uncommitted, non-empty ``checkpoints/step_*`` entries without this trainer's ``OWNER.json`` (or symlinks).

    The trainer never deletes them; it stops before any work instead (a later save of that step would collide).
    """
    root = Path(run_dir) / "checkpoints"
    return [
        p for p in _step_entries(root) if p.is_symlink() or not (_is_committed(p) or _is_owned(p) or _is_empty_dir(p))
    ]


def _not_ours(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is in the way of {why} and was not written by this trainer (no {OWNER_FILE} "
        "naming its step): it is left alone; move it out of the checkpoints directory and relaunch"
    )


def _remove_own(path: Path, why: str) -> None:
    """Delete ``path`` if this trainer wrote it (``OWNER.json``) or it is empty; refuse anything else."""
    if _is_empty_dir(path):
        path.rmdir()
    elif _is_owned(path):
        shutil.rmtree(path)
    else:
        raise _not_ours(path, why)


class CheckpointManager:
    """Find, save, verify, load and prune the checkpoints of one run directory.

    Args:
        run_dir: the run's output directory (checkpoints go to ``<run_dir>/checkpoints``).
        keep_last: committed checkpoints kept after each commit (>= 1; 1 is safe: a new checkpoint commits
            before the old one is deleted).
        info: this process's rank and world size.
        fallback_to_previous: with ``resume=auto``, set aside a checkpoint that fails verification or the pickle
            scan (`set_aside`) and resume from the newest one that passes, with a warning, instead of stopping.
    """

    def __init__(
        self,
        run_dir: str | Path,
        keep_last: int,
        info: dist.DistInfo,
        fallback_to_previous: bool = True,
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.info = keep_last, info
        self.fallback_to_previous = fallback_to_previous

    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        return sorted((p for p in _step_entries(self.root) if _is_committed(p)), key=_step_of)

    def candidates(self, resume: str) -> list[Path]:
        """Checkpoints to try, best first: ``auto`` = committed ones newest first, ``none`` = [], else the path.

        Collective for ``auto``: rank 0 lists the directory and every rank takes its list. On a shared file system
        another node's view of a directory can lag (NFS caches directory attributes for up to a minute), so a node
        listing for itself could miss a checkpoint committed just before a requeue and load an older one than its
        peers, which then fail in mismatched collectives."""
        if resume == "none":
            return []
        if resume == "auto":
            return dist.broadcast_object(self.committed()[::-1] if self.info.is_main else None)
        path = Path(resume)
        if not (path / COMMIT_MARKER).is_file():
            raise CheckpointError(f"checkpoint.resume={resume}: no {COMMIT_MARKER} marker; the save never finished")
        return [path]

    def remove_uncommitted(self) -> None:
        """Delete leftovers of this trainer's interrupted saves (rank 0, at start, before any new save can be in
        progress). An uncommitted entry it did not write is left alone, with a warning naming it."""
        if self.info.is_main:
            foreign = foreign_leftovers(self.root.parent)
            for p in foreign:
                log.warning(
                    "leaving %s alone: not a committed checkpoint and not written by this trainer (no %s); "
                    "move it out of %s if it is not needed",
                    p,
                    OWNER_FILE,
                    self.root,
                )
            for p in _step_entries(self.root):
                if p not in foreign and not _is_committed(p):
                    log.warning("removing uncommitted checkpoint directory %s (an interrupted save of this run)", p)
                    _remove_own(p, "the cleanup of interrupted saves")
        dist.barrier()

    def _start_save(self, step: int, final: Path, tmp: Path) -> None:
        """Rank 0: remove an old ``tmp`` of this trainer, create ``tmp`` and write its ``OWNER.json`` before
        anything else. A foreign directory at ``tmp`` or ``final`` fails every rank before any write; an own
        ``final`` (a re-run with ``checkpoint.resume=none``) stays until the new save replaces it."""
        problem = None
        if self.info.is_main:
            try:
                if tmp.exists() or tmp.is_symlink():
                    _remove_own(tmp, f"the save of step {step}")
                if (final.exists() or final.is_symlink()) and not (_is_owned(final) or _is_empty_dir(final)):
                    raise _not_ours(final, f"the save of step {step}")
                tmp.mkdir(parents=True)
                owner = {"writer": OWNER_WRITER, "step": step, "run_dir": redact(str(self.root.parent.resolve()))}
                try:
                    write_text(tmp / OWNER_FILE, json.dumps(owner, sort_keys=True))
                except OSError:
                    # Created just above, so ours to remove: left with a torn OWNER.json it would look foreign
                    # and stop the next start.
                    shutil.rmtree(tmp)
                    raise
            except CheckpointError as err:
                problem = str(err)
        problem = dist.broadcast_object(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def save(
        self,
        step: int,
        engine: Any,
        trainer_state: dict[str, Any],
        export: Callable[[dict[str, torch.Tensor], Path], None] | None,
        save_point: Callable[[str], None] | None = None,
    ) -> Path:
        """Save everything needed for an exact resume (collective: every rank must call it); ``save_point`` is
        called with each of `SAVE_POINTS` as the save passes it.

        Raises:
            SaveFailedError: a file could not be written (disk full, file-size limit, permission): one line with
                the cause, the file and the last good checkpoint, which the failed save never touches.
        """
        final = self.root / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            return self._save(step, final, tmp, engine, trainer_state, export, save_point or (lambda point: None))
        except save_failure.SaveFailedError:
            raise
        except Exception as err:
            # A failure after the rename (the marker's write) leaves the unfinished save at ``final``.
            cause = save_failure.describe(err, final if final.exists() and not tmp.exists() else tmp)
            if cause is None:
                raise
            raise self._failed(step, cause) from err

    def _save_part(self, step: int, directory: Path, part: Callable[[], None]) -> None:
        """Run one part of a save, then agree with every rank on how it went, in place of a barrier.

        A write that fails on one rank (often only rank 0 writes: the export, the trainer state, the manifest)
        stops every rank here together, each with the same one-line `SaveFailedError` naming the rank, so the run
        reports the cause once. Without the agreement the other ranks went on into the next collective and failed
        there, described as if they had hit the write error themselves (over gloo) or waited out the collective
        timeout (NCCL). An error that is not a failed write is re-raised on its rank with its traceback (a bug);
        the other ranks still stop here.

        Raises:
            SaveFailedError: some rank could not write (``directory`` is where its files were going).
        """
        error: Exception | None = None
        cause: str | None = None
        try:
            part()
        except Exception as err:
            error, cause = err, save_failure.describe(err, directory)
        outcomes = dist.all_gather_object(
            None if error is None else (cause is not None, cause or f"{type(error).__name__} (not a failed write)")
        )
        failed = [(rank, outcome[1]) for rank, outcome in enumerate(outcomes) if outcome is not None]
        if not failed:
            return
        if error is not None and cause is None:
            raise error
        rank, first = failed[0]
        raise self._failed(step, first, rank)

    def _failed(self, step: int, cause: str, rank: int | None = None) -> save_failure.SaveFailedError:
        where = f" on rank {rank}" if rank is not None and self.info.world_size > 1 else ""
        return save_failure.SaveFailedError(
            f"checkpoint save of step {step} failed{where}: {cause}; {self._last_good()}"
        )

    def _last_good(self) -> str:
        good = self.committed()
        if not good:
            return f"no checkpoint was committed before in {self.root}, so a relaunch starts from step 0"
        return (
            f"the last good checkpoint is step {_step_of(good[-1])} ({good[-1]}), untouched; the same command "
            "resumes from it once that is fixed (the unfinished save is removed at the next start)"
        )

    def _save(
        self,
        step: int,
        final: Path,
        tmp: Path,
        engine: Any,
        trainer_state: dict[str, Any],
        export: Callable[[dict[str, torch.Tensor], Path], None] | None,
        reached: Callable[[str], None],
    ) -> Path:
        t0 = time.perf_counter()
        self._start_save(step, final, tmp)
        dist.barrier()

        def shards() -> None:
            engine.save(tmp)
            reached("engine")
            if self.info.cp_rank == 0:  # one RNG stream per data-parallel rank: its context-parallel group shares it
                with replacing(tmp / f"rng_rank{self.info.dp_rank}.pt") as rng_file:
                    torch.save(_rng_state(), rng_file)
            reached("rng")

        def export_and_state() -> None:
            if export is not None:
                weights = engine.full_state_dict()
                if self.info.is_main:
                    export(weights, tmp / "export")
            reached("export")
            if self.info.is_main:
                state = {"format": STATE_FORMAT, "step": step, "world_size": self.info.world_size, **trainer_state}
                write_text(tmp / TRAINER_STATE, json.dumps(state, indent=1, sort_keys=True))
            reached("trainer_state")

        def manifest() -> None:
            write_integrity(tmp, self.info)
            reached("manifest")

        def commit() -> None:
            if not self.info.is_main:
                return
            if final.exists():
                _remove_own(final, f"the save of step {step}")  # checked by _start_save: this trainer's own
            move(tmp, final)
            _fsync_dir(self.root)
            reached("renamed")
            write_text(final / COMMIT_MARKER, json.dumps({"step": step, "time": time.time()}), fsync=True)
            self._prune()

        for part in (shards, export_and_state, manifest):
            self._save_part(step, tmp, part)
        self._save_part(step, final, commit)
        log.info("checkpoint step %d committed at %s (%.1f s)", step, final, time.perf_counter() - t0)
        return final

    def _prune(self) -> None:
        """Delete this trainer's oldest committed checkpoints beyond ``keep_last``; others are never counted or
        touched."""
        own = [p for p in self.committed() if _is_owned(p)]
        for old in own[: -self.keep_last]:
            try:
                # The marker goes first, so a half-deleted directory is never mistaken for a checkpoint.
                (old / COMMIT_MARKER).unlink()
                shutil.rmtree(old)
                log.info("deleted old checkpoint %s (checkpoint.keep_last=%d)", old, self.keep_last)
            except OSError as err:
                log.warning(
                    "could not delete old checkpoint %s: %s; training continues (an uncommitted leftover "
                    "is removed at the next start)",
                    old,
                    err,
                )

    def read_state(
        self,
        path: Path,
        model_config: dict[str, Any],
        parallel: dict[str, Any],
        check: Callable[[Path, dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Verify ``path`` and return its trainer state, refusing what this run cannot load. Reads no tensor.

        Args:
            path: a committed checkpoint directory.
            model_config: this run's ``GCAConfig.to_dict()``; any difference is refused, naming the fields.
            parallel: this run's layout, ``{"engine", "zero_stage"}``; the world size comes from ``info``.
            check: called with the verified state before the architecture and layout checks, so that the
                trainer's comparison of the whole config (``pipeline.train.resume_check``) reports a changed
                ``model.*`` or ``parallel.*`` key together with every other change.

        Raises:
            CheckpointCorruptError: integrity check failed (see `verify_integrity`), or the trainer state does not
                have the shape a save writes (`read_trainer_state`; the check's `JsonFileError` too).
            CheckpointError: another format version, architecture, engine, or a world size the engine cannot
                re-shard.
        """
        fmt = _format_of(path / TRAINER_STATE)
        if fmt is not None and fmt < STATE_FORMAT:
            raise CheckpointError(
                f"{path}: trainer state format {fmt} was written by an older release (this one reads format "
                f"{STATE_FORMAT}, which adds the integrity manifest, the parallel layout and the data fingerprint); "
                "version migration: finish that run with the release that wrote it, or start a new run "
                "(checkpoint.resume=none) from its eval export"
            )
        verify_integrity(path, self.info)
        state = read_trainer_state(path)
        try:
            if check is not None:
                check(path, state)
        except JsonFileError as err:  # a field the check parses further (the recorded config) is malformed
            raise CheckpointCorruptError(f"unusable trainer state: {err}") from None
        saved = state["model_config"]
        # Backends choose how the same model is computed (a GPU run may resume on CPU), not what it computes.
        compared = (set(saved) | set(model_config)) - set(BACKEND_FIELDS)
        diff = sorted(k for k in compared if saved.get(k) != model_config.get(k))
        if diff:
            details = ", ".join(
                f"model.{k}: checkpoint {saved.get(k)!r} vs config {model_config.get(k)!r}" for k in diff
            )
            raise CheckpointError(f"{path} was trained with a different architecture: {details}")
        self._check_layout(path, state, parallel)
        return state

    def _check_layout(self, path: Path, state: dict[str, Any], parallel: dict[str, Any]) -> None:
        old, new = state["parallel"], parallel
        if old["engine"] != new["engine"] or old["zero_stage"] != new["zero_stage"]:
            raise CheckpointError(
                f"{path} was written by parallel.engine={old['engine']} (zero_stage={old['zero_stage']}), this run "
                f"uses parallel.engine={new['engine']} (zero_stage={new['zero_stage']}); their checkpoint formats "
                "differ: resume with the same engine, or start a new run from the checkpoint's eval export"
            )
        saved_world, world = int(state["world_size"]), self.info.world_size
        if saved_world != world:
            if old["engine"] == "deepspeed" and old["zero_stage"] >= 1:
                raise CheckpointError(
                    f"{path} holds DeepSpeed ZeRO-{old['zero_stage']} optimizer state partitioned over {saved_world} "
                    f"ranks; this run has {world}. Resume with {saved_world} ranks (the data position would carry "
                    "over, but DeepSpeed cannot re-partition this optimizer state here), or convert it with "
                    "DeepSpeed's ds_to_universal.py"
                )
            log.warning(
                "%s was saved by %d ranks, resuming on %d: model, optimizer and data position carry over "
                "exactly; per-rank RNG streams (Gumbel noise) of new ranks start fresh",
                path,
                saved_world,
                world,
            )

    def load(self, path: Path, engine: Any) -> None:
        """Restore engine state and this rank's RNG from a checkpoint that passed `read_state` and
        `scan_pickles`."""
        engine.load(path)
        rng_file = path / f"rng_rank{self.info.dp_rank}.pt"  # the stream of this data-parallel rank, any CP degree
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        else:
            log.warning(
                "%s has no RNG state for data-parallel rank %d; its RNG stream restarts", path, self.info.dp_rank
            )

    def restore(
        self,
        resume: str,
        engine: Any,
        model_config: dict[str, Any],
        parallel: dict[str, Any],
        check: Callable[[Path, dict[str, Any]], None] | None = None,
    ) -> tuple[Path, dict[str, Any]] | None:
        """Resume per ``checkpoint.resume``: verify, check, scan, then load; returns (path, trainer state) or None.

        ``check(path, state)`` runs after verification and before any tensor is loaded (see `read_state`; the
        trainer's config comparison and data-fingerprint check). A checkpoint that fails verification (its
        manifest, its files, its trainer state's fields) or the pickle scan is never loaded; with
        ``fallback_to_previous`` and ``resume=auto`` the next older committed one is tried, and once one passes,
        every one that failed is set aside (`set_aside`) with a warning line.

        Raises:
            CheckpointCorruptError, UnsafeCheckpointError: the checkpoint (or, falling back, every one) failed;
                one line naming it, why, and the way out; nothing was loaded, moved or deleted.
        """
        found = self.candidates(resume)
        may_fall_back = self.fallback_to_previous and resume == "auto"
        rejected: list[tuple[Path, CheckpointError]] = []
        for path in found:
            try:
                state = self.read_state(path, model_config, parallel, check)
                scan_pickles(path)
            except (CheckpointCorruptError, UnsafeCheckpointError) as err:
                if not may_fall_back:
                    raise type(err)(f"{err}; {_way_out(path, resume)}") from None
                rejected.append((path, err))
                continue
            self._set_aside(rejected, path, int(state["step"]))
            self.load(path, engine)
            log.info("resumed from %s at step %d", path, state["step"])
            return path, state
        if rejected:
            why = rejected[0][1]
            others = f"; the older ones fail too: {', '.join(str(p) for p, _ in rejected[1:])}" if rejected[1:] else ""
            raise type(why)(
                f"{why}{others}; no committed checkpoint in {self.root} passes, nothing was loaded: move the damaged "
                "ones out of it to start afresh, or start a new run in another run_dir"
            ) from None
        return None

    def _set_aside(self, rejected: list[tuple[Path, CheckpointError]], good: Path, step: int) -> None:
        """Rank 0 renames each rejected checkpoint out of the trainer's way, one warning line each; every rank
        stops together if a rename fails."""
        problem = None
        if self.info.is_main:
            for path, err in rejected:
                try:
                    aside = set_aside(path)
                except OSError as oserr:
                    problem = f"{err}; could not set it aside ({oserr}): move it out of {self.root} and relaunch"
                    break
                log.warning(
                    "not resuming from %s: %s; set aside as %s (kept for inspection, never loaded, deleted or saved "
                    "over); resuming from %s (step %d), the newest checkpoint that passes "
                    "(checkpoint.fallback_to_previous=false stops instead)",
                    path,
                    err,
                    aside,
                    good,
                    step,
                )
        problem = dist.broadcast_object(problem)
        if problem is not None:
            raise CheckpointCorruptError(problem)


def _way_out(path: Path, resume: str) -> str:
    if resume == "auto":
        return (
            f"nothing was loaded (checkpoint.fallback_to_previous=false): move {path} out of {path.parent} to resume "
            "from the checkpoint before it, or drop that setting to have it set aside"
        )
    return f"nothing was loaded: checkpoint.resume={resume} names this checkpoint and no other"


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that failed verification or the pickle scan to ``step_N.rejected`` (``-2``, ``-3``,
    ... when taken) and return the new path.

    Its content is not proven to be this trainer's (``OWNER.json`` is one of the files that may have been changed),
    so it is never deleted; and left at ``step_N`` it would be saved over when the run reaches step N again.
    Under its new name no listing of step entries matches it: it is never resumed from, pruned or cleaned up.
    """
    aside, n = path.with_name(f"{path.name}.rejected"), 1
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = path.with_name(f"{path.name}.rejected-{n}")
    move(path, aside)
    return aside

"""Preflight: check every node before a launch, and say what is wrong in one line per problem.

Run it with the launcher and the arguments of the training run it guards, so it sees the same ranks, devices and
config (``launch/slurm/pretrain.sbatch`` does this at every start and restart)::

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0:29500 \\
        launch/preflight.py --gpus-per-node 8 --config configs/train/x.yaml [key=value ...]

Checks, each failure one ``preflight: <host> rank <r>: <what>: <why and the fix>`` line:

- accelerators: the node has ``--gpus-per-node`` GPUs and this rank can allocate on ``cuda:<local rank>``;
- backend: a one-element all-reduce over the training backend (NCCL on GPUs, gloo on CPUs) gives the right sum;
  a hang anywhere (a missing node, a blocked port) ends the run after ``--timeout-s`` with a line saying so;
- data: ``data.path`` is a complete prepared dataset (``manifest.json`` + ``_COMPLETE``), its train split (and
  the val split when ``train.eval_every`` > 0) has a safe index, every listed shard present as a regular file and
  at least one sample, the index is the one the manifest records and holds the counts it records
  (`data_prep.format.split_count_mismatch`), and its tokenizer is the one the manifest records (kind and sha256)
  and fits ``model.vocab_size``;
- checkpoint dir: ``run_dir`` is writable on every node and shared (a file written by rank 0 is seen by every node);
- free disk: ``run_dir`` has room for ``checkpoint.keep_last + 1`` checkpoints (estimated from the parameter
  count) and at least ``--min-free-gb``;
- shared memory: ``/dev/shm`` files that crashed streaming loaders (``NNNNNN_*``, which streaming's own cleaner
  misses for prefixes other than 0) and DeepSpeed's CPU allreduce leave behind are removed when no process on
  the node maps or holds them (so a running job is never touched);
- versions: python, torch, triton, deepspeed, streaming, numpy, ... (and CUDA) are the same on every rank (the
  trainer repeats this one at every start, `version_mismatches`, whatever the launcher).

Node-local checks (data, disk, shared memory) run once per node, on local rank 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as tdist

from data_prep import format as fmt
from data_prep.dataset_tokenizer import manifest_mismatch, read_tokenizer_files
from data_prep.safe_files import INDEX_FILENAME, UnsafeDatasetError, index_file_names, read_index, stat_regular
from data_prep.safe_write import write_bytes, write_text
from model import build_model, count_parameters
from pipeline.data.reader import is_remote
from pipeline.train import dist
from pipeline.train.config import ConfigError, TrainConfig, load_config
from pipeline.train.inputs import split_mismatch
from pipeline.train.metrics import setup_logging, versions

log = logging.getLogger(__name__)

STALE_SHM_PATTERNS = ("[0-9][0-9][0-9][0-9][0-9][0-9]_*", "deepspeed_allreduce_buffer_*")
"""Shared-memory names of streaming's per-run state (``<prefix>_<name>``) and DeepSpeed's CPU allreduce buffers."""
STATE_BYTES_PER_PARAM = 12
"""fp32 weights (4) + AdamW moments (8) in a checkpoint; engines shard them across ranks, the sum is the same."""
EXPORT_BYTES_PER_PARAM = 4
"""The fp32 safetensors eval export inside each checkpoint (``checkpoint.export``)."""


@dataclass
class Report:
    """What one rank found; gathered on rank 0."""

    host: str
    rank: int
    local_rank: int
    versions: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def check_accelerators(gpus_per_node: int | None, local_rank: int) -> list[str]:
    """This rank's GPU works, and the node has ``gpus_per_node`` of them (``None``: no count expected, 0: CPU)."""
    if gpus_per_node == 0:
        return []
    if not torch.cuda.is_available():
        if gpus_per_node is None:
            return []
        return [
            f"accelerators: expected {gpus_per_node} GPUs per node but torch {torch.__version__} sees none "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); for a CPU-only run pass "
            "--gpus-per-node 0 (CPU_ONLY=1 for launch/slurm/pretrain.sbatch)"
        ]
    count = torch.cuda.device_count()
    if gpus_per_node is not None and count < gpus_per_node:
        return [
            f"accelerators: {count} GPUs visible, expected {gpus_per_node} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        ]
    if local_rank >= count:
        return [
            f"accelerators: local rank {local_rank} has no GPU ({count} visible); start at most {count} ranks per node"
        ]
    try:
        (torch.ones(1, device=f"cuda:{local_rank}") + 1).item()
    except RuntimeError as err:
        return [f"accelerators: cuda:{local_rank} does not work: {str(err).strip().splitlines()[0]}"]
    return []


def check_split(path: str, split: str) -> list[str]:
    """The split's ``index.json`` passes the readers' checks (``data_prep.safe_files``: shard names inside the
    split, no pickle column), every shard it lists is present as a regular file, and it holds samples. Only
    ``lstat`` per shard: nothing is opened but the index, nothing is written."""
    split_dir = Path(path) / split
    try:
        index, _ = read_index(split_dir)
        missing = [
            i
            for i, shard in enumerate(index["shards"])
            if not any(stat_regular(split_dir, name) is not None for name in index_file_names(shard))
        ]
    except UnsafeDatasetError as err:
        return [f"data: {err}"]
    except OSError as err:
        return [f"data: cannot read {split_dir / INDEX_FILENAME}: {err.strerror or err}"]
    if missing:
        return [
            f"data: {split_dir}: {len(missing)} shard(s) listed in index.json are missing (first: shard "
            f"{missing[0]}); re-run data prep"
        ]
    if not sum(shard["samples"] for shard in index["shards"]):
        return [
            f"data: {split_dir} holds no samples; re-run data prep on more documents (or a larger val_fraction), "
            "or point data.path at another dataset"
        ]
    return []


def check_data(path: str, train_split: str, vocab_size: int, val_split: str | None = None) -> list[str]:
    """``path`` is a complete prepared dataset whose tokenizer is the one its manifest records, whose train split
    (and ``val_split`` when given) pass `check_split` and whose tokens fit the model's vocabulary."""
    if is_remote(path):
        log.info("data.path %s is remote: not checked here (the trainer validates shards as it reads them)", path)
        return []
    try:
        manifest = fmt.read_manifest(path)
    except (fmt.IncompleteDatasetError, ValueError, KeyError, OSError) as err:
        return [f"data: {err}" if path in str(err) else f"data: {path}: {err}"]
    failures = []
    try:
        tokenizer = read_tokenizer_files(Path(path))
    except UnsafeDatasetError as err:
        failures.append(f"data: {err}")
    else:
        if (problem := manifest_mismatch(Path(path), manifest.tokenizer, tokenizer)) is not None:
            failures.append(f"data: {problem}; re-run data prep, or restore the tokenizer it wrote")
    for split in (train_split, val_split):
        if split is None:
            continue
        problems = check_split(path, split)
        if not problems and (mismatch := split_mismatch(Path(path), split, manifest)) is not None:
            problems = [f"data: {mismatch}"]
        failures += problems
    if manifest.tokenizer.vocab_size > vocab_size:
        failures.append(
            f"data: the tokenizer of {path} has {manifest.tokenizer.vocab_size} pieces but "
            f"model.vocab_size={vocab_size}; set model.vocab_size >= {manifest.tokenizer.vocab_size}"
        )
    return failures


def check_writable(run_dir: Path) -> list[str]:
    """A file can be created, synced and removed in ``run_dir`` (created if missing)."""
    probe = run_dir / f".preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_bytes(probe, b"ok", fsync=True)
        probe.unlink()
    except OSError as err:
        return [f"checkpoint dir: cannot write to {run_dir}: {err.strerror or err}"]
    return []


def checkpoint_bytes(cfg: TrainConfig) -> int:
    """Estimated size of one checkpoint: the parameter count (model built on the meta device) x bytes per param."""
    with torch.device("meta"):
        n_params = count_parameters(build_model(cfg.model))
    return n_params * (STATE_BYTES_PER_PARAM + (EXPORT_BYTES_PER_PARAM if cfg.checkpoint.export else 0))


def check_free_disk(run_dir: Path, need_bytes: int) -> list[str]:
    """The file system of ``run_dir`` (or of its nearest existing parent) has ``need_bytes`` free."""
    where = run_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need_bytes:
        return [
            f"free disk: {free / 2**30:.1f} GiB free at {where}, need {need_bytes / 2**30:.1f} GiB "
            "(checkpoint.keep_last + 1 checkpoints, or --min-free-gb); free space or lower checkpoint.keep_last"
        ]
    return []


def open_files(proc: Path = Path("/proc")) -> set[str]:
    """Paths that any process we may inspect maps into memory or holds open."""
    found: set[str] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for line in (pid_dir / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    found.add(parts[5])
            for fd in (pid_dir / "fd").iterdir():
                found.add(os.readlink(fd))
        except OSError:  # the process ended, or belongs to another user (whose files we cannot delete anyway)
            continue
    return found


def clean_stale_shm(shm_dir: Path = Path("/dev/shm"), proc: Path = Path("/proc")) -> list[Path]:
    """Remove leftover shared memory of crashed runs (`STALE_SHM_PATTERNS`) that no process uses; return them."""
    in_use = open_files(proc)
    removed = []
    for pattern in STALE_SHM_PATTERNS:
        for path in sorted(shm_dir.glob(pattern)):
            if str(path) in in_use or not path.is_file():
                continue
            try:
                path.unlink()
                removed.append(path)
            except OSError as err:  # another user's file: it does not block us, streaming takes a free prefix
                log.warning("cannot remove stale shared memory %s: %s", path, err.strerror)
    if removed:
        log.info(
            "removed %d stale shared-memory files from crashed runs: %s",
            len(removed),
            " ".join(p.name for p in removed),
        )
    return removed


def compare_versions(reports: list[Report]) -> list[str]:
    """One line per rank whose versions differ from rank 0's, naming the packages."""
    ref = reports[0]
    lines = []
    for r in reports[1:]:
        diff = sorted(k for k in set(ref.versions) | set(r.versions) if ref.versions.get(k) != r.versions.get(k))
        if diff:
            what = ", ".join(f"{k} {r.versions.get(k)} (rank 0 on {ref.host}: {ref.versions.get(k)})" for k in diff)
            lines.append(
                f"preflight: {r.host} rank {r.rank}: versions: {what}; install the same environment on every node"
            )
    return lines


def version_mismatches(info: dist.DistInfo) -> list[str]:
    """Every rank's library versions compared with rank 0's (one all-gather); the same lines on every rank, each
    naming a host, a rank and the packages that differ. Empty in a single process."""
    if not tdist.is_initialized():
        return []
    gathered: list[Report | None] = [None] * info.world_size
    tdist.all_gather_object(gathered, Report(socket.gethostname(), info.rank, info.local_rank, _local_versions()))
    return compare_versions([r for r in gathered if r is not None])


def _local_versions() -> dict[str, str]:
    # Library versions only: the device name may differ (mixed GPU models are allowed), and the git commit of a
    # shared checkout can change between two ranks' reads while someone commits (the run log records it).
    return {k: v for k, v in versions().items() if k != "device"}


def _collective_checks(cfg: TrainConfig, info: dist.DistInfo, report: Report) -> list[str]:
    """Backend, shared run_dir and version checks; returns the failure lines of the whole job."""
    total = torch.ones(1, device=info.device)
    tdist.all_reduce(total)
    if int(total.item()) != info.world_size:
        report.failures.append(f"backend: all-reduce of ones gave {total.item()}, expected {info.world_size}")
    token = [uuid.uuid4().hex if info.is_main else ""]
    tdist.broadcast_object_list(token, src=0)
    probe = Path(cfg.run_dir) / f".preflight-shared-{token[0]}"
    if info.is_main:
        try:
            write_text(probe, token[0])
        except OSError:
            pass  # rank 0's run_dir is not writable: already reported by check_writable
    dist.barrier()
    if info.local_rank == 0 and not info.is_main and not probe.is_file():
        report.failures.append(
            f"checkpoint dir: {cfg.run_dir} is not shared with rank 0's node; every node writes "
            "into the same checkpoint, so put run_dir on a shared file system"
        )
    dist.barrier()
    if info.is_main:
        probe.unlink(missing_ok=True)
    gathered: list[Report | None] = [None] * info.world_size
    tdist.all_gather_object(gathered, report)
    reports = [r for r in gathered if r is not None]
    return [_line(r, failure) for r in reports for failure in r.failures] + compare_versions(reports)


def _line(report: Report, failure: str) -> str:
    return f"preflight: {report.host} rank {report.rank}: {failure}"


def run(
    cfg: TrainConfig, info: dist.DistInfo, report: Report, gpus_per_node: int | None, min_free_gb: float
) -> list[str]:
    """All checks of this rank, recorded in ``report``; returns every failure line of the job."""
    report.failures += check_accelerators(gpus_per_node, info.local_rank)
    if info.local_rank == 0:
        run_dir = Path(cfg.run_dir)
        clean_stale_shm()
        val_split = cfg.data.val_split if cfg.train.eval_every > 0 else None
        report.failures += check_data(cfg.data.path, cfg.data.train_split, cfg.model.vocab_size, val_split)
        report.failures += check_writable(run_dir)
        need = max(int(min_free_gb * 2**30), checkpoint_bytes(cfg) * (cfg.checkpoint.keep_last + 1))
        report.failures += check_free_disk(run_dir, need)
    if not tdist.is_initialized():
        log.info("preflight: one process, so the backend, shared run_dir and version checks are skipped")
        return [_line(report, failure) for failure in report.failures]
    return _collective_checks(cfg, info, report)


def main(
    config_path: str | None, overrides: list[str], gpus_per_node: int | None, min_free_gb: float, timeout_s: float
) -> int:
    """What ``pipeline.cli.preflight`` runs: 0 if every check passed on every rank, 1 if not, 2 on a bad config.

    Rank 0 logs every rank's failures at the end. A rank that gets stuck (a collective never completes) logs
    its own failures and a timeout line after ``timeout_s`` and exits 1.
    """
    try:
        dist.check_launch()  # before rank_from_env reads RANK: a malformed one is one line, not a traceback
    except ValueError as err:
        setup_logging(0)
        log.error("preflight: %s", err)
        return 2
    setup_logging(dist.rank_from_env())
    try:
        cfg = load_config(config_path, overrides, dist.world_size_from_env())
    except ConfigError as err:
        log.error("preflight: configuration error: %s", err)
        return 2
    report = Report(socket.gethostname(), dist.rank_from_env(), 0, _local_versions())

    def give_up() -> None:
        for failure in report.failures:
            log.error("%s", _line(report, failure))
        log.error(
            "%s",
            _line(
                report,
                f"backend: no answer from the other ranks within {timeout_s:.0f} s: a node "
                "or rank is missing, or the network between nodes blocks the backend (check "
                "the rendezvous host/port and NCCL_SOCKET_IFNAME)",
            ),
        )
        logging.shutdown()
        os._exit(1)  # a collective stuck in C++ cannot be interrupted from Python

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    started = time.perf_counter()
    try:
        try:
            # The group's own timeout comes later than the watchdog's, so a hang always ends in the watchdog's line.
            info = dist.init_distributed("none", timeout_s=int(timeout_s) + 60)
        except (RuntimeError, ValueError) as err:
            log.error(
                "%s", _line(report, f"backend: cannot create the process group: {str(err).strip().splitlines()[0]}")
            )
            return 1
        report.local_rank = info.local_rank
        setup_logging(info.rank)
        failures = run(cfg, info, report, gpus_per_node, min_free_gb)
    finally:
        watchdog.cancel()
    if info.is_main:
        for line in failures:
            log.error("%s", line)
        if failures:
            log.error("preflight FAILED: %d problem(s); fix them before launching", len(failures))
        else:
            log.info(
                "preflight OK: %d rank(s), data %s, run_dir %s (%.1f s)",
                info.world_size,
                cfg.data.path,
                cfg.run_dir,
                time.perf_counter() - started,
            )
    dist.barrier()  # no rank tears the group down while another still has a collective in flight
    dist.destroy()
    return 1 if failures else 0

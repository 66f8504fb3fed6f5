"""One training per ``run_dir``: rank 0 holds an OS lock on ``<run_dir>/run.lock`` for the whole run.

Two trainings writing one ``run_dir`` remove each other's in-progress saves and interleave their metrics, so the
second is refused at the start, before it writes anything, naming the holder. The lock is ``flock``: the kernel
(or, on NFS, the file server) drops it when the holding process ends, however it ends, so a crashed run leaves
nothing that blocks the next one. The file also holds a JSON record of the holder (host, pid, start time, SLURM
job), read only to say who holds the lock.

One run takes one lock: only global rank 0 locks, and every rank learns the outcome from one broadcast, so the
ranks of one run (on any number of nodes) are never refused and all ranks of a refused run stop together.

A start that stopped before writing anything but the lock (a configuration refused after the lock was taken)
leaves ``run_dir`` as it found it: it removes the ``run.lock`` it created, and ``run_dir`` when it created that. The
file is unlinked while the lock is held, and `acquire` checks that the file it locked is still the one at the path,
so a start that opened the old file in that moment takes a fresh one instead of a lock nobody else sees.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data_prep.safe_write import UnsafeWriteError, open_lock
from pipeline.train import dist, launch_env

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
LOCK_TRIES = 10
"""Locks of a lock file that failed starts removed meanwhile, before `acquire` gives up (one is already rare)."""


class RunDirLockError(RuntimeError):
    """This run may not write its ``run_dir``: another training holds it, or the lock file cannot be made."""


class RunLock:
    """The held lock of ``run_dir``; ``release`` (closing the file) drops it.

    Args:
        fd: the locked ``run.lock``.
        found: the names ``run_dir`` held before this start, or None when this start created ``run_dir``.
    """

    def __init__(self, fd: int, run_dir: Path, found: set[str] | None) -> None:
        self._fd: int | None = fd
        self.run_dir, self.found = run_dir, found

    def release(self) -> None:
        """Drop the lock; when the run added nothing to ``run_dir`` but a new ``run.lock``, remove that file (and
        ``run_dir`` when this start created it)."""
        if self._fd is None:
            return
        found = self.found if self.found is not None else set()
        try:
            if LOCK_FILE not in found and set(os.listdir(self.run_dir)) == found | {LOCK_FILE}:
                (self.run_dir / LOCK_FILE).unlink()  # while held: see `acquire`
                if self.found is None:
                    self.run_dir.rmdir()
        except OSError as err:  # something appeared meanwhile, or the folder went away: nothing of ours to remove
            log.debug("run_dir=%s: the failed start's lock file stays: %s", self.run_dir, err)
        finally:
            os.close(self._fd)
            self._fd = None


def hold(run_dir: Path, info: dist.DistInfo) -> RunLock | None:
    """Rank 0 takes the lock of ``run_dir`` (`acquire`); the other ranks get ``None``.

    Raises:
        RunDirLockError: on every rank, when rank 0 was refused (rank 0's message).
    """
    lock, refusal = None, None
    if info.is_main:
        try:
            lock = acquire(run_dir, os.environ)
        except RunDirLockError as err:
            refusal = str(err)
    refusal = dist.broadcast_object(refusal)
    if refusal is not None:
        raise RunDirLockError(refusal)
    return lock


def acquire(run_dir: Path, environ: Mapping[str, str]) -> RunLock:
    """Lock ``run_dir`` for this process and record it as the holder.

    Not refused: a lock held by an earlier incarnation of this SLURM job (`_earlier_incarnation`), and a file
    system without ``flock`` (warned: there the lock cannot keep a second training out).

    Raises:
        RunDirLockError: another process holds the lock (the message names its host and pid), or ``run.lock``
            cannot be created or is not a regular file.
    """
    path = run_dir / LOCK_FILE
    for _ in range(LOCK_TRIES):
        try:
            found = set(os.listdir(run_dir)) if run_dir.exists() else None
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = open_lock(path)  # a planted link must never make the trainer write into the file it points at
        except UnsafeWriteError as err:
            raise RunDirLockError(f"run_dir={run_dir}: {err}") from None
        except OSError as err:
            raise RunDirLockError(f"run_dir={run_dir}: cannot create the lock file {path}: {err}") from None
        try:
            _lock(fd, run_dir, path, environ)
        except BaseException:
            os.close(fd)
            raise
        if _still_at(fd, path):
            return RunLock(fd, run_dir, found)
        os.close(fd)  # locked a file a failed start removed in the meantime (`RunLock.release`): lock the new one
    raise RunDirLockError(f"run_dir={run_dir}: {path} keeps being replaced while this run locks it")


def _still_at(fd: int, path: Path) -> bool:
    """Whether the locked file ``fd`` is still the file at ``path``."""
    try:
        found = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _lock(fd: int, run_dir: Path, path: Path, environ: Mapping[str, str]) -> None:
    """Take the lock on the open lock file ``fd`` and write this process's record into it (see `acquire`)."""
    mine = _record(environ)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_record(fd)
        if not _earlier_incarnation(holder, mine):
            raise RunDirLockError(
                f"run_dir={run_dir} is in use by another training ({_describe(holder)}; lock {path})"
                f"{_leftover_hint(holder, path)}; wait for it to end, or set another run_dir"
            ) from None
        log.warning(
            "run_dir=%s: the lock %s is still held by an earlier run of this SLURM job (%s), which SLURM ended "
            "before this requeue (a lost node's lock lasts until the file server's lease ends); continuing",
            run_dir,
            path,
            _describe(holder),
        )
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise RunDirLockError(f"run_dir={run_dir}: cannot lock {path}: {err}") from None
        log.warning(
            "run_dir=%s: this file system does not support flock (%s), so a second training into the same "
            "run_dir would not be refused; make sure only one runs",
            run_dir,
            err,
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(mine).encode(), 0)


def _record(environ: Mapping[str, str]) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slurm_cluster": environ.get("SLURM_CLUSTER_NAME"),
        "slurm_job_id": environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": launch_env.integer(environ, "SLURM_RESTART_COUNT", 0),
    }


def _read_record(fd: int) -> dict[str, Any]:
    """The holder's record; empty when it is being written right now, or was written by something else."""
    try:
        record = json.loads(os.pread(fd, 65536, 0))
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _earlier_incarnation(holder: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether the holder is this SLURM job before a requeue (same cluster and job id, fewer restarts). SLURM
    runs one incarnation of a job at a time, so such a holder is gone even while its lock is still held. Two runs
    of one incarnation (two sruns in one allocation) have the same restart count and are refused."""
    if mine["slurm_job_id"] is None or holder.get("slurm_job_id") != mine["slurm_job_id"]:
        return False
    if holder.get("slurm_cluster") != mine["slurm_cluster"]:
        return False
    restarts = holder.get("slurm_restart_count")
    return isinstance(restarts, int) and restarts < mine["slurm_restart_count"]


def _leftover_hint(holder: dict[str, Any], path: Path) -> str:
    """When the recorded holder ran on this host and is gone, a process it started (inheriting the open lock file)
    holds the lock. It may still write, so the run is refused all the same; this says how to find it."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"; pid {pid} no longer runs on this host, but a process it started keeps the lock: `fuser {path}`"
    except PermissionError:
        pass  # it runs, as another user
    return ""


def _describe(holder: dict[str, Any]) -> str:
    if not holder.get("host"):
        return "holder unknown: its record is being written or was not written by this trainer"
    text = f"host {holder['host']}, pid {holder.get('pid')}, started {holder.get('started')}"
    if holder.get("slurm_job_id"):
        text += f", SLURM job {holder['slurm_job_id']} (restart {holder.get('slurm_restart_count')})"
    return text

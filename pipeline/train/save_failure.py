"""Why a checkpoint save could not write, in words: the cause (a full disk, a file-size limit, a permission) and
the file.

The writers a save goes through report the same fault in three ways: Python raises an ``OSError`` with the errno
and the file name; safetensors (Rust) raises a ``SafetensorError`` whose text ends in ``(os error N)`` and names no
file; torch's zip writer raises a ``RuntimeError`` (``unexpected pos N vs M``, ``iostream error``) that keeps
neither the errno nor the file. For that last one the cause is found afterwards on disk: a file of the save that
reached the process's file-size limit (``ulimit -f``; Python ignores SIGXFSZ, so the write fails with EFBIG), or a
file system with no space left. Anything else is not described, and the caller re-raises it unchanged (a failed
collective, for one, has its own handling).
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from pathlib import Path

from data_prep.safe_write import FailedWrite, failed_write

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_NEARLY_FULL_BYTES = 1 << 20
"""Free space below this after a failed write counts as a full disk: a file system rarely fills to the last byte
(block granularity, root's reserve), and no save of a model fits in it anyway."""
_ADVICE = {
    errno.ENOSPC: "free space on that file system",
    errno.EDQUOT: "free space on that file system or raise the quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or save to a file system without one",
    errno.EACCES: "make the run directory writable for this user",
    errno.EPERM: "make the run directory writable for this user",
    errno.EROFS: "put run_dir on a writable file system",
}


class SaveFailedError(Exception):
    """A checkpoint save could not write; the message is one line (cause, file, the last good checkpoint)."""


def _errno_of(err: BaseException) -> int | None:
    if isinstance(err, OSError) and err.errno:
        return err.errno
    found = _RUST_OS_ERROR.search(str(err))
    return int(found[1]) if found else None


def _files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()] if directory.is_dir() else []


def _latest_written(directory: Path) -> Path:
    """The file of the save written last, which is the one being written when the error came; the save's
    directory itself when it holds none yet."""
    files = _files(directory)
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else directory


def _at_size_limit(directory: Path, failed: FailedWrite | None) -> tuple[Path, int] | None:
    """A file of the save that has grown to this process's file-size limit (the one a failed write had reached,
    whose temporary file is gone, or one still on disk), and the limit."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    if failed is not None and failed.bytes_written >= limit:
        return failed.path, limit
    full = [p for p in _files(directory) if p.stat().st_size >= limit]
    return (full[0], limit) if full else None


def _free_bytes(path: Path) -> int:
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def describe(err: BaseException, directory: Path) -> str | None:
    """``"<cause> writing <file>; <what to do>"`` for a write into the save directory ``directory`` that failed
    with ``err``, or None when ``err`` is not a failed write."""
    code = _errno_of(err)
    failed = failed_write(err)
    if code is not None:
        filename = getattr(err, "filename", None)
        where = failed.path if failed else Path(filename) if filename else _latest_written(directory)
        advice = _ADVICE.get(code, "check the file system of the run directory")
        if code in (errno.ENOSPC, errno.EDQUOT):
            advice += f" ({_free_bytes(directory)} bytes free now)"
        return f"{os.strerror(code)} (errno {code}) writing {where}; {advice}"
    if not isinstance(err, RuntimeError):
        return None
    at_limit = _at_size_limit(directory, failed)
    if at_limit is not None:
        path, limit = at_limit
        return (
            f"the file-size limit (ulimit -f, {limit} bytes) was reached writing {path} ({_first_line(err)}); "
            f"{_ADVICE[errno.EFBIG]}"
        )
    if _free_bytes(directory) < _NEARLY_FULL_BYTES:
        return (
            f"the file system is full ({_free_bytes(directory)} bytes free) writing "
            f"{failed.path if failed else _latest_written(directory)} "
            f"({_first_line(err)}); {_ADVICE[errno.ENOSPC]}"
        )
    return None

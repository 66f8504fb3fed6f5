"""Writing a file inside a folder without writing through a link someone planted there: the one way every tool
of the project creates, appends to or replaces a file.

A run folder, an eval ``--out``, an export or a demo's folder may sit on a shared file system where someone else
can create names before the tool writes them. A symbolic link planted at ``run_dir/metrics.jsonl`` (or a hard
link to another user's file) would make a plain ``open(path, "a")`` append into the file it points at. So:

- `write_bytes` / `write_text` / `replacing` never open the final name: they write a fresh temporary file next to
  it (created with ``O_EXCL``, which never follows a link) and ``rename`` it over the name, which replaces a
  directory entry and never writes through one;
- `open_append` / `open_lock` open the name itself with ``O_NOFOLLOW`` (a symbolic link fails) and ``O_NONBLOCK``
  (a FIFO fails instead of blocking), then check on the descriptor that it is a regular file with one link;
- `move` renames a file or folder the tool wrote onto its final name, never onto a link;
- `check_name` refuses a name that is a symbolic link, a hard link shared with another name, or not a regular
  file, before anything is written, with one line naming the path (`UnsafeWriteError`).

Only the last component is guarded: the folders themselves (``run_dir``, ``run_dir/checkpoints``, ``--out``) may
be symbolic links, because the user names them (checkpoints on another file system are common). Files get the
modes of a plain ``open``: ``0o666`` less the umask, also when a library wrote the file `replacing` handed it by
a temporary file of its own (safetensors does, created owner-only) and renamed that over it. This lives in
``data_prep`` because prep writes with it and may not import the pipeline; ``model.io`` uses it too (the one
import of ``data_prep`` from ``model``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

__all__ = [
    "FailedWrite",
    "UnsafeWriteError",
    "check_name",
    "check_names",
    "failed_write",
    "open_append",
    "open_lock",
    "move",
    "replacing",
    "write_bytes",
    "write_text",
]

_FILE_MODE = 0o666
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_HINT = "this tool writes only files it creates itself; remove or move it, or choose another folder"


class UnsafeWriteError(ValueError):
    """A file the tool is about to write is a link or not a regular file; the message names the path."""


class FailedWrite(NamedTuple):
    """What `replacing` knew when the write into its temporary file failed (the file itself is removed)."""

    path: Path
    """The name being written (not the temporary one)."""
    bytes_written: int


_FAILED_WRITE_ATTRIBUTE = "_safe_write_failure"


def failed_write(err: BaseException) -> FailedWrite | None:
    """The file `replacing` was writing when ``err`` came out of it, or None. A library's error often names no
    file (safetensors, torch's zip writer), and the temporary file is gone, so this is how a report names it."""
    found = getattr(err, _FAILED_WRITE_ATTRIBUTE, None)
    return found if isinstance(found, FailedWrite) else None


def _describe(path: Path, st: os.stat_result) -> str | None:
    """Why a file of this ``lstat`` must not be written (None when it is a plain regular file of one link)."""
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"a symbolic link (to {target})"
    if not stat.S_ISREG(st.st_mode):
        return next((kind for test, kind in _KINDS if test(st.st_mode)), "not a regular file")
    if st.st_nlink > 1:
        return f"a hard link shared with {st.st_nlink - 1} other name(s)"
    return None


def _refusal(path: Path, why: str) -> UnsafeWriteError:
    return UnsafeWriteError(f"refusing to write {path}: it is {why}; {_HINT}")


def check_name(path: str | os.PathLike[str]) -> None:
    """Refuse to write ``path`` if it exists as anything but a regular file of one link (missing is fine).

    Raises:
        UnsafeWriteError: naming the path and what it is (a symbolic link and its target, a hard link, a FIFO...).
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a folder on the way may not exist yet)
        return
    why = _describe(path, st)
    if why is not None:
        raise _refusal(path, why)


def check_names(directory: str | os.PathLike[str], names: list[str]) -> None:
    """`check_name` for each of ``names`` inside ``directory``: run before any work that would end by writing them."""
    for name in names:
        check_name(Path(directory) / name)


def _open_checked(path: Path, flags: int) -> int:
    """``os.open`` that never follows a link at ``path`` nor blocks on a FIFO there, and returns only a descriptor
    of a regular file with one link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, _FILE_MODE)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            check_name(path)  # names what is there
        raise
    st = os.fstat(fd)
    why = _describe(path, st)
    if why is not None:
        os.close(fd)
        raise _refusal(path, why)
    os.set_blocking(fd, True)
    return fd


def open_append(path: str | os.PathLike[str], binary: bool = False) -> IO[Any]:
    """``path`` opened for appending (created if missing), never through a link (see the module docstring).

    Raises:
        UnsafeWriteError: ``path`` is a symbolic or hard link, a FIFO, a device or a directory.
    """
    fd = _open_checked(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "ab" if binary else "a", encoding=None if binary else "utf-8")


def open_lock(path: str | os.PathLike[str]) -> int:
    """A read-write descriptor of ``path`` (created if missing) for a lock file, never through a link."""
    return _open_checked(Path(path), os.O_RDWR | os.O_CREAT)


def _fresh_temp(path: Path) -> tuple[Path, int]:
    """A new empty file next to ``path`` under a name nobody could have planted (``O_EXCL`` with a random part),
    and the mode it was created with: ``0o666`` less the umask, read from the file because asking for the umask
    means setting it, which would race with other threads creating files."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
        except FileExistsError:
            continue
        try:
            return tmp, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    raise FileExistsError(errno.EEXIST, "no free temporary name next to the file", str(path))


def _finish(tmp: Path, mode: int, fsync: bool) -> None:
    """Give the written temporary file ``mode`` (a library may have replaced it by an owner-only file of its own)
    and, with ``fsync``, bring its data to the disk."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], fsync: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary path next to ``path`` for the caller (or a library: ``torch.save``, safetensors,
    matplotlib) to write; on success it gets the umask's mode and is renamed over ``path`` (a reader sees the old
    file or the new one, never half of one), on failure it is removed. ``fsync``: the file's data and then its
    folder's entry reach the disk before this returns (what a checkpoint's commit needs).

    Raises:
        UnsafeWriteError: ``path`` is a symbolic or hard link or not a regular file (checked before and after).
    """
    path = Path(path)
    check_name(path)
    tmp, mode = _fresh_temp(path)
    try:
        yield tmp
        _finish(tmp, mode, fsync)
        check_name(path)  # the caller may have run for long: something may have been planted meanwhile
        os.replace(tmp, path)
        if fsync:
            _fsync_folder(path.parent)
    except BaseException as err:
        try:
            written = os.lstat(tmp).st_size
            os.unlink(tmp)
        except FileNotFoundError:
            written = 0
        with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__ keeps none
            setattr(err, _FAILED_WRITE_ATTRIBUTE, FailedWrite(path, written))
        raise


def _write_with(path: str | os.PathLike[str], write: Callable[[Path], object], fsync: bool) -> Path:
    with replacing(path, fsync) as tmp:
        write(tmp)
    return Path(path)


def write_bytes(path: str | os.PathLike[str], data: bytes, fsync: bool = False) -> Path:
    """Replace ``path`` with ``data`` (see `replacing`); returns ``path``."""
    return _write_with(path, lambda tmp: tmp.write_bytes(data), fsync)


def write_text(path: str | os.PathLike[str], text: str, fsync: bool = False) -> Path:
    """Replace ``path`` with ``text`` in UTF-8 (see `replacing`); returns ``path``."""
    return _write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), fsync)


def move(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Rename ``source`` (a file or folder the tool made) to ``target``, replacing what is there only if it is of the
    same kind: a regular file of one link for a file, a folder (empty: ``rename`` refuses others) for a folder.

    Raises:
        UnsafeWriteError: ``target`` is a symbolic or hard link, or of another kind than ``source``.
    """
    target = Path(target)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISDIR(os.lstat(source).st_mode):
            why = None if stat.S_ISDIR(st.st_mode) else _describe(target, st) or "a file, not a folder"
        else:
            why = _describe(target, st)
        if why is not None:
            raise _refusal(target, why)
    os.replace(source, target)

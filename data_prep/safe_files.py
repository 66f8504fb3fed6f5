"""Reading a dataset directory without trusting it: the one validation every dataset reader goes through.

A prepared dataset may come from someone else (a shared file system, a download). Its ``index.json`` names the
shard files, and nothing stops it from naming ``../../x``, an absolute path, a symbolic link to a file of the
user, a FIFO (a read that never returns) or ``/dev/zero`` (one that never ends). So every reader -- the trainer,
the eval haystack, the slice merge and preflight -- goes through these functions:

- `check_index`: the index is an MDS index whose file names are plain relative paths inside the split directory
  (no ``..``, no leading ``/`` or ``.``), each used once, and whose columns never unpickle (pickle runs code);
  run before any shard file is opened or created;
- `stat_regular` / `open_regular` / `read_regular`: a file inside a directory is reached without following any
  symbolic link below that directory, and must be a regular file (checked on the open descriptor, so a file
  swapped after the check is caught too).

The directory itself (``data.path``, a split directory) may be a symbolic link: the user names it. Nothing here
writes anything. This lives in ``data_prep`` because the merge reads slices with it and may not import the
pipeline.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "INDEX_FILENAME",
    "UnsafeColumnError",
    "UnsafeDatasetError",
    "UnsafeShardPathError",
    "check_index",
    "check_shard_path",
    "index_file_names",
    "open_regular",
    "parse_index",
    "read_index",
    "read_regular",
    "is_within",
    "stat_regular",
]

INDEX_FILENAME = "index.json"

_SAFE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_UNSAFE_ENCODINGS = ("pkl",)
_FILE_KEYS = ("raw_data", "zip_data", "raw_meta", "zip_meta")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
"""``O_DIRECTORY`` fails on a FIFO or device before it is opened; ``O_NONBLOCK`` is a second guard."""
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnsafeDatasetError(ValueError):
    """A dataset asks for something a reader refuses to do (leave its directory, read a non-regular file, ...)."""


class UnsafeShardPathError(UnsafeDatasetError):
    """A shard file name in ``index.json`` is not a plain relative path inside the split directory."""


class UnsafeColumnError(UnsafeDatasetError):
    """A column uses an encoding that runs code when decoded (pickle)."""


def is_within(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or lies inside it, by its written or its resolved (links followed) location."""
    root = root.resolve()
    return any(p == root or root in p.parents for p in (path.absolute(), path.resolve()))


def check_shard_path(name: object, where: str) -> str:
    """``name`` if it is a relative POSIX path of plain parts (letters, digits, ``_ . -``; no ``..``, no leading
    ``.``, no ``/`` at the start, no backslash) -- so it cannot leave the split directory -- else raise.

    Raises:
        UnsafeShardPathError: naming ``where`` and the offending name.
    """
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name != "/".join(parts) or not all(_SAFE_PART.fullmatch(p) for p in parts):
        raise UnsafeShardPathError(
            f"{where}: shard file name {name!r} is not a plain relative path inside the "
            "split directory (path traversal?); refusing the dataset before opening any shard"
        )
    return str(name)


def _check_shard(shard: Any, i: int, where: str, seen: set[str]) -> None:
    if not isinstance(shard, dict):
        raise UnsafeDatasetError(f"{where}: shard {i} is not an object")
    if shard.get("format") != "mds" or not isinstance(shard.get("raw_data"), dict):
        raise UnsafeDatasetError(
            f"{where}: shard {i} is not an MDS shard (format {shard.get('format')!r}, "
            "raw_data missing?); only data prep's MDS shards are read"
        )
    samples = shard.get("samples")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise UnsafeDatasetError(f"{where}: shard {i} has samples={samples!r}, not a count")
    for key in _FILE_KEYS:
        info = shard.get(key)
        if info is None:
            continue
        name = check_shard_path(info.get("basename") if isinstance(info, dict) else info, f"{where}: shard {i} {key}")
        if name in seen:  # two entries on one file would let evicting one shard delete the other's cached copy
            raise UnsafeDatasetError(f"{where}: shard {i} {key}: file {name!r} is listed twice in the index")
        seen.add(name)
    for name, encoding in zip(shard.get("column_names", []), shard.get("column_encodings", [])):
        if str(encoding).split(":")[0] in _UNSAFE_ENCODINGS:
            raise UnsafeColumnError(
                f"{where}: shard {i} column {name!r} has encoding {encoding!r}, which "
                "unpickles (runs code) on read; the trainer never reads such columns"
            )


def check_index(index: Any, where: str) -> None:
    """Validate an MDS ``index.json`` object before any shard is touched: every shard is an MDS shard whose file
    names are safe relative paths (`check_shard_path`), each used once, and no column uses pickle.

    Raises:
        UnsafeDatasetError (or its subclasses): naming ``where``, the shard and the problem.
    """
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise UnsafeDatasetError(f"{where}: not an MDS index (no 'shards' list)")
    if index.get("version") != 2:
        raise UnsafeDatasetError(f"{where}: MDS index version {index.get('version')!r}, expected 2")
    seen: set[str] = set()
    for i, shard in enumerate(index["shards"]):
        _check_shard(shard, i, where, seen)


def index_file_names(shard: dict[str, Any]) -> list[str]:
    """The file names one (checked) shard entry lists: raw first, then compressed."""
    return [shard[key]["basename"] for key in _FILE_KEYS if isinstance(shard.get(key), dict)]


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, for messages: "a FIFO", "a character device", ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(path: Path, mode: int) -> UnsafeDatasetError:
    return UnsafeDatasetError(
        f"{path} is {file_kind(mode)}, not a regular file; a dataset is read only from regular "
        "files inside its directory (replace it with the real file, or re-run data prep)"
    )


def _open_dir_below(directory: Path, parts: list[str]) -> int:
    """A descriptor of ``directory/parts...`` reached without following a symbolic link below ``directory``."""
    fd = os.open(directory, _DIR_FLAGS)
    for depth, part in enumerate(parts):
        try:
            nxt = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeDatasetError(
                    f"{directory.joinpath(*parts[: depth + 1])} is not a real directory (a "
                    "symbolic link?); a dataset's files must lie inside its directory"
                ) from None
            raise
        os.close(fd)
        fd = nxt
    return fd


def stat_regular(directory: Path, name: str) -> os.stat_result | None:
    """``lstat`` of ``directory/name`` (``name`` a checked relative path), or None when it does not exist.

    Raises:
        UnsafeDatasetError: it exists but is not a regular file, or a directory on the way is a symbolic link.
    """
    parts = name.split("/")
    try:
        fd = _open_dir_below(directory, parts[:-1])
    except FileNotFoundError:
        return None
    try:
        st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(directory / name, st.st_mode)
    return st


def open_regular(directory: Path, name: str) -> int:
    """A read-only descriptor of the regular file ``directory/name``, reached without following any symbolic
    link below ``directory``. The file is checked with ``lstat`` first and, as it may be swapped in between, on
    the descriptor again (``O_NOFOLLOW`` refuses a symbolic link, ``O_NONBLOCK`` keeps a FIFO from blocking).

    Raises:
        FileNotFoundError: it does not exist.
        UnsafeDatasetError: it is a symbolic link, directory, FIFO, device or socket.
    """
    parts = name.split("/")
    dir_fd = _open_dir_below(directory, parts[:-1])
    try:
        # Refused before the open: opening a device can act (a tape rewinds, a watchdog arms).
        mode = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(directory / name, mode)
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _not_regular(directory / name, stat.S_IFLNK) from None
        raise
    finally:
        os.close(dir_fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(directory / name, mode)
    return fd


def read_regular(directory: Path, name: str, expected_size: int | None = None) -> bytes:
    """The bytes of the regular file ``directory/name`` (see `open_regular`).

    Args:
        expected_size: when given, a file of another size is refused before it is read (a shard that grew to
            gigabytes is never loaded into memory).

    Raises:
        FileNotFoundError, UnsafeDatasetError: as `open_regular`; UnsafeDatasetError also for a size mismatch.
    """
    with os.fdopen(open_regular(directory, name), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            raise UnsafeDatasetError(
                f"{directory / name}: {size} bytes, but the index records {expected_size}; the "
                "file changed since data prep wrote it (re-run data prep)"
            )
        return f.read()


def read_index(split_dir: Path) -> tuple[dict[str, Any], bytes]:
    """Read and check (`check_index`) ``split_dir/index.json``; returns the index and its exact bytes.

    Raises:
        FileNotFoundError: there is no ``index.json``.
        UnsafeDatasetError: it is not a regular file, not JSON, or not a safe MDS index.
    """
    raw = read_regular(split_dir, INDEX_FILENAME)
    return parse_index(raw, str(split_dir / INDEX_FILENAME)), raw


def parse_index(raw: bytes, where: str) -> dict[str, Any]:
    """The checked (`check_index`) MDS index in ``raw``, the bytes of ``where``.

    Raises:
        UnsafeDatasetError: not JSON, or not a safe MDS index.
    """
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise UnsafeDatasetError(f"{where}: not valid JSON ({err}); re-run data prep for this split") from None
    check_index(index, where)
    return index

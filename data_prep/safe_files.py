"""Reading a dataset directory without trusting it: the one validation every dataset reader goes through.

A prepared dataset may come from someone else (a shared file system, a download). Its ``index.json`` names the
shard files, and nothing stops it from naming ``../../x``, an absolute path, a symbolic link to a file of the
user, a FIFO (a read that never returns) or ``/dev/zero`` (one that never ends). So every reader -- the trainer,
the eval haystack, the slice merge and preflight -- goes through these functions:

- `parse_index` / `check_index`: the index is read through ``data_prep.json_file`` (size and nesting bounded
  before the parse) and is an MDS index whose every field has the type and range data prep writes (a sample
  count of ``1e30`` is one line naming the field, not an OverflowError later), whose file names are plain
  relative paths inside the split directory (no ``..``, no leading ``/`` or ``.``), each used once, and whose
  columns never unpickle (pickle runs code); run before any shard file is opened or created;
- `stat_regular` / `open_regular` / `read_regular`: a file inside a directory is reached without following any
  symbolic link below that directory, and must be a regular file (checked on the open descriptor, so a file
  swapped after the check is caught too);
- `read_followed`: a file in a folder the user names (``tokenizer.path``, a dense checkpoint), links followed,
  must be a regular file of bounded size.

The directory itself (``data.path``, a split directory) may be a symbolic link: the user names it. Nothing here
writes anything. This lives in ``data_prep`` because the merge reads slices with it and may not import the
pipeline.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

from data_prep.json_file import DEFAULT_MAX_BYTES, Fields, JsonFileError, parse_json

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
    "read_followed",
    "read_index_bytes",
    "read_regular",
    "is_within",
    "stat_regular",
]

INDEX_FILENAME = "index.json"

_SAFE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_UNSAFE_ENCODINGS = ("pkl",)
_FILE_KEYS = ("raw_data", "zip_data")
_SHARD_KEYS = {
    "column_encodings",
    "column_names",
    "column_sizes",
    "compression",
    "format",
    "hashes",
    "raw_data",
    "samples",
    "size_limit",
    "version",
    "zip_data",
}
"""What streaming's ``MDSWriter`` writes for a shard, and all its ``MDSReader`` takes."""
CONFIG_KEYS = tuple(sorted(_SHARD_KEYS - {"raw_data", "zip_data", "samples"}))
"""The fields of a shard that are the writer's config, which the shard file repeats as JSON."""
_FILE_INFO_KEYS = {"basename", "bytes", "hashes"}
MAX_SHARD_SAMPLES = 2**32 - 1
"""An MDS shard file stores its sample count as a uint32."""
MAX_FILE_BYTES = 2**63 - 1
"""A file size (``off_t``)."""
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
    if isinstance(name, str) and _SAFE_PART.fullmatch(name):
        return name  # one plain part (what data prep writes): the common case of 100,000-shard indexes, made cheap
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name != "/".join(parts) or not all(_SAFE_PART.fullmatch(p) for p in parts):
        raise UnsafeShardPathError(
            f"{where}: shard file name {name!r} is not a plain relative path inside the "
            "split directory (path traversal?); refusing the dataset before opening any shard"
        )
    return str(name)


def _refuse(where: str, field: str, problem: str) -> NoReturn:
    raise UnsafeDatasetError(f"{where}: field '{field}' {problem}; only data prep's MDS indexes are read")


def _check_file(shard: Fields, i: int, key: str, where: str, seen: set[str]) -> None:
    """The ``raw_data`` / ``zip_data`` entry of a shard: a safe file name, used once, a byte count and hashes."""
    info = shard.nested(key)
    name = check_shard_path(info.obj.get("basename"), f"{where}: shard {i} {key}")
    if name in seen:  # two entries on one file would let evicting one shard delete the other's cached copy
        raise UnsafeDatasetError(f"{where}: shard {i} {key}: file {name!r} is listed twice in the index")
    seen.add(name)
    info.integer("bytes", low=0, high=MAX_FILE_BYTES)
    if not set(map(type, info.mapping("hashes").values())) <= {str}:
        _refuse(where, f"{info.prefix}hashes", "is not an object of hex strings")
    if info.obj.keys() != _FILE_INFO_KEYS:
        key = min(info.obj.keys() ^ _FILE_INFO_KEYS)
        _refuse(where, f"{info.prefix}{key}", "is missing" if key in _FILE_INFO_KEYS else "is not one an MDS file has")


def _check_config(shard: Fields, i: int, where: str) -> None:
    """The fields of a shard that are the writer's config (`CONFIG_KEYS`): the same for every shard of a dataset."""
    shard.integer("version", low=2, high=2)
    shard.string("format", choices=("mds",))
    if shard.obj.get("size_limit") is not None:
        shard.integer("size_limit", low=1, high=MAX_FILE_BYTES)
    if shard.obj.get("compression") is not None:
        shard.string("compression")
    names, encodings, sizes = (shard.sequence(key) for key in ("column_names", "column_encodings", "column_sizes"))
    if not all(isinstance(item, str) for item in names + encodings) or not len(names) == len(encodings) == len(sizes):
        _refuse(where, f"{shard.prefix}column_names", "does not give one name, encoding and size per column")
    if not all(size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 0) for size in sizes):
        _refuse(where, f"{shard.prefix}column_sizes", "is not a list of byte sizes or nulls")
    hashes = shard.sequence("hashes")
    if not all(isinstance(item, str) for item in hashes):
        _refuse(where, f"{shard.prefix}hashes", "is not a list of hash names")
    for name, encoding in zip(names, encodings, strict=True):
        if encoding.split(":")[0] in _UNSAFE_ENCODINGS:
            raise UnsafeColumnError(
                f"{where}: shard {i} column {name!r} has encoding {encoding!r}, which "
                "unpickles (runs code) on read; the trainer never reads such columns"
            )


def _check_shard(shard: Fields, i: int, where: str, seen: set[str], configs: set[str]) -> None:
    """One entry of ``shards``: every field streaming's MDS reader takes (no other: it would refuse one with a
    TypeError), each of the type and range data prep writes. ``configs`` holds the configs already checked, by
    their ``repr`` (which tells ``2`` from ``2.0`` and ``true``), so an index of 100,000 shards checks one."""
    if shard.obj.keys() != _SHARD_KEYS:
        key = min(shard.obj.keys() ^ _SHARD_KEYS)
        _refuse(where, f"{shard.prefix}{key}", "is missing" if key in _SHARD_KEYS else "is not one an MDS shard has")
    config = repr([shard.obj[key] for key in CONFIG_KEYS])
    if config not in configs:
        _check_config(shard, i, where)
        configs.add(config)
    shard.integer("samples", low=0, high=MAX_SHARD_SAMPLES)
    _check_file(shard, i, "raw_data", where, seen)
    if shard.obj["zip_data"] is not None:
        _check_file(shard, i, "zip_data", where, seen)


def check_index(index: Any, where: str) -> None:
    """Validate an MDS ``index.json`` object before any shard is touched: every shard is an MDS shard whose fields
    have the types and ranges data prep writes (``data_prep.json_file.Fields``: a sample count of ``1e30`` or
    ``null`` is named, never an OverflowError or TypeError later), whose file names are safe relative paths
    (`check_shard_path`), each used once, and no column uses pickle.

    Raises:
        UnsafeDatasetError (or its subclasses): one line naming ``where``, the shard or field and the problem.
    """
    try:
        fields = Fields(index, where)
        fields.integer("version", low=2, high=2)
        shards = fields.sequence("shards")
        seen: set[str] = set()
        configs: set[str] = set()
        for i, shard in enumerate(shards):
            _check_shard(Fields(shard, where, f"shards[{i}]."), i, where, seen, configs)
    except JsonFileError as err:
        raise UnsafeDatasetError(f"{err}; only data prep's MDS indexes are read") from None


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


def read_regular(directory: Path, name: str, expected_size: int | None = None, max_size: int | None = None) -> bytes:
    """The bytes of the regular file ``directory/name`` (see `open_regular`).

    Args:
        expected_size: when given, a file of another size is refused before it is read (a shard that grew to
            gigabytes is never loaded into memory).
        max_size: when given, a larger file is refused before it is read, and no more than that is ever read.

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
        if max_size is not None and size > max_size:
            raise UnsafeDatasetError(f"{directory / name}: {size:,} bytes, more than the {max_size:,} read of it")
        # read(size + 1), never read(max_size + 1): Python allocates the whole request before reading
        data = f.read() if max_size is None else f.read(size + 1)
        if max_size is not None and len(data) > size:
            raise UnsafeDatasetError(f"{directory / name}: grew while it was read (more than its {size:,} bytes)")
        return data


def read_index(split_dir: Path) -> tuple[dict[str, Any], bytes]:
    """Read and check (`check_index`) ``split_dir/index.json``; returns the index and its exact bytes.

    Raises:
        FileNotFoundError: there is no ``index.json``.
        UnsafeDatasetError: it is not a regular file, not JSON, or not a safe MDS index.
    """
    raw = read_index_bytes(split_dir)
    return parse_index(raw, str(split_dir / INDEX_FILENAME)), raw


def read_index_bytes(split_dir: Path) -> bytes:
    """The bytes of ``split_dir/index.json``, a regular file of at most ``DEFAULT_MAX_BYTES`` (an index of 100,000
    shards is ~45 MB), unchecked: for a caller that hashes them before `parse_index`.

    Raises:
        FileNotFoundError: there is no ``index.json``. UnsafeDatasetError: not a regular file, or too large.
    """
    return read_regular(split_dir, INDEX_FILENAME, max_size=DEFAULT_MAX_BYTES)


def parse_index(raw: bytes, where: str) -> dict[str, Any]:
    """The checked (`check_index`) MDS index in ``raw``, the bytes of ``where``, parsed by
    ``data_prep.json_file.parse_json`` (nesting bounded before the parse, no NaN).

    Raises:
        UnsafeDatasetError: not JSON, or not a safe MDS index.
    """
    try:
        index = parse_json(raw, where)
    except JsonFileError as err:
        raise UnsafeDatasetError(f"{err}; re-run data prep for this split") from None
    check_index(index, where)
    return index


def read_followed(path: Path, max_size: int = DEFAULT_MAX_BYTES) -> bytes | None:
    """The bytes of a file in a folder the user names (``tokenizer.path``, a dense checkpoint, which the HF cache
    fills with links, so links are followed): a regular file of at most ``max_size`` bytes; None when there is
    none. A FIFO or device is refused before it is opened (a read would block or never end) and again on the
    descriptor.

    Raises:
        UnsafeDatasetError: not a regular file, unreadable, or larger than ``max_size`` (one line naming it).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UnsafeDatasetError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UnsafeDatasetError(f"{path} is {file_kind(mode)}, not a regular file")
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            mode = st.st_mode
            # at most max_size + 1, but no more than the file holds: Python allocates the whole request up front
            data = f.read(min(st.st_size, max_size) + 1) if stat.S_ISREG(mode) else b""
    except OSError as err:
        raise UnsafeDatasetError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UnsafeDatasetError(f"{path} is {file_kind(mode)}, not a regular file")
    if len(data) > max_size:
        raise UnsafeDatasetError(f"{path}: more than the {max_size:,} bytes read of it")
    if len(data) > st.st_size:
        raise UnsafeDatasetError(f"{path}: grew while it was read (more than its {st.st_size:,} bytes)")
    return data

"""Reading back a JSON file the tools wrote, without trusting it: the one validator for every such file.

Trainer state, checkpoint integrity manifests, dataset and dense-checkpoint indexes and export configs are all
files that someone may have edited and resealed (recomputed the hash that guards them). A plain
``json.loads(path.read_text())`` followed by ``obj["step"]`` then fails deep inside the code that uses the value:
a ``RecursionError`` for nesting 200,000 deep, an ``OverflowError`` for a count of ``1e30``, a ``TypeError`` for a
``null`` where an object belongs, or worse, it works with a value out of range. So every reader:

- reads the file with `read_json` (or parses bytes it already has with `parse_json`): a regular file only (a FIFO
  would block, ``/dev/zero`` never ends), at most ``max_bytes``, nesting at most ``max_depth`` deep (checked
  before the parse, so nothing recurses), no ``NaN``/``Infinity`` (not JSON);
- takes each value through `Fields`, which checks its type and range and names the file and the field when it
  does not fit.

Every problem is a `JsonFileError` (a ``ValueError``) whose message is one line naming the file and, where there
is one, the field. This lives in ``data_prep`` because prep reads indexes with it and may not import the
pipeline; ``model`` uses it for export configs and dense-checkpoint indexes.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "Fields",
    "JsonFileError",
    "parse_json",
    "read_json",
    "summarize",
]

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
"""Larger than any index the tools write (an index of 100,000 shards is ~40 MB), small enough to refuse a file that
would fill memory."""
DEFAULT_MAX_DEPTH = 32
"""The tools' own files nest at most ~5 deep; anything deeper was not written by them."""
_SHOWN_CHARS = 60
_CHUNK = 1 << 20
"""Bytes `_max_depth` looks at at once: its arrays take ~15 bytes per byte, so ~15 MiB."""


class JsonFileError(ValueError):
    """A JSON file the tools read back is unreadable or does not have the shape they wrote; one line, naming it."""


def _max_depth(raw: bytes) -> int:
    """The deepest bracket nesting of ``raw`` (brackets inside strings do not count), without recursion.

    Done with array operations, in chunks of bounded memory, as a 100,000-shard index is ~45 MB and is read at
    every start: escape pairs go first (``\\\\`` then ``\\"``, left to right as JSON pairs them), so every
    remaining quote opens or closes a string; a byte is inside a string when an odd number of quotes precede it;
    the depth is the running sum of +1 per opening and -1 per closing bracket outside strings."""
    data = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    codes = np.frombuffer(data, dtype=np.uint8)
    in_string, depth, deepest = 0, 0, 0
    for start in range(0, len(codes), _CHUNK):
        chunk = codes[start : start + _CHUNK]
        inside = np.bitwise_xor.accumulate((chunk == ord('"')).view(np.uint8)) ^ in_string
        steps = ((chunk == ord("[")) | (chunk == ord("{"))).view(np.int8) - ((chunk == ord("]")) | (chunk == ord("}")))
        running = np.cumsum(np.where(inside == 0, steps, 0), dtype=np.int64) + depth
        in_string, depth, deepest = int(inside[-1]), int(running[-1]), max(deepest, int(running.max()))
    return deepest


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if abs(value) == float("inf"):
        raise ValueError(f"{text} is out of range for a number")
    return value


def parse_json(raw: bytes | str, where: str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The JSON value in ``raw`` (the bytes of ``where``), its nesting checked before the parse.

    Raises:
        JsonFileError: not UTF-8 JSON, nested deeper than ``max_depth``, or using ``NaN``/``Infinity``.
    """
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    depth = _max_depth(data)
    if depth > max_depth:
        raise JsonFileError(f"{where}: JSON nested {depth} deep (at most {max_depth} is read)")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as err:
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise JsonFileError(f"{where}: not valid JSON ({reason})") from None


def read_json(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The JSON value in the regular file ``path``, read with the checks of `parse_json`.

    Raises:
        FileNotFoundError: ``path`` does not exist (callers often have their own answer for that).
        JsonFileError: not a regular file, larger than ``max_bytes``, or not JSON the tools would write.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError as err:
        raise JsonFileError(f"{path}: cannot be read ({err.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO or device?)"
        raise JsonFileError(f"{path}: {kind}, not a JSON file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > max_bytes:
            raise JsonFileError(f"{path}: {st.st_size:,} bytes, more than the {max_bytes:,} read for a JSON file")
        raw = f.read(st.st_size + 1)  # never read(max_bytes + 1): Python allocates the whole request up front
    if len(raw) > st.st_size:
        raise JsonFileError(f"{path}: grew while it was read (more than its {st.st_size:,} bytes)")
    return parse_json(raw, str(path), max_depth=max_depth)


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def summarize(items: Iterable[Any], limit: int = 10) -> str:
    """``a, b, c`` for a short list; the first ``limit`` and ``... and 19,990 more`` for a long one, so a message
    about a hostile file stays one readable line."""
    items = list(items)
    shown = ", ".join(str(item) for item in items[:limit])
    return shown if len(items) <= limit else f"{shown} ... and {len(items) - limit:,} more"


_MISSING: Any = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _within(value: Any, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


class Fields:
    """The values of one JSON object, each taken with its type and range checked.

    ``Fields(obj, "ckpt/trainer_state.json")`` refuses an ``obj`` that is not an object; ``fields.integer("step",
    low=0)`` returns the value or raises `JsonFileError` naming the file, the field and what was found. A
    ``default`` is returned when the key is absent (not when it is present with a wrong type).
    """

    def __init__(self, obj: Any, where: str, prefix: str = "") -> None:
        self.where = where
        self.prefix = prefix
        if not isinstance(obj, dict):
            self._fail(f"{prefix.rstrip('.') or 'the file'} is {_kind(obj)}, expected an object")
        self.obj: dict[str, Any] = obj

    def _fail(self, message: str) -> NoReturn:
        raise JsonFileError(f"{self.where}: {message}")

    def _take(self, key: str, default: Any, fits: Callable[[Any], bool], expected: str) -> Any:
        """The value under ``key`` if ``fits`` accepts it; ``default`` when the key is absent and one was given."""
        if key not in self.obj:
            if default is _MISSING:
                self._fail(f"field '{self.prefix}{key}' is missing")
            return default
        value = self.obj[key]
        if not fits(value):
            self._fail(f"field '{self.prefix}{key}' is {_shown(value)}, expected {expected}")
        return value

    def integer(self, key: str, *, low: int | None = None, high: int | None = None, default: Any = _MISSING) -> Any:
        """An integer (not a boolean, not a float) in ``[low, high]``."""
        bounded = low is not None or high is not None
        bounds = f" in [{'-inf' if low is None else low}, {'inf' if high is None else high}]" if bounded else ""
        return self._take(key, default, lambda v: _is_int(v) and _within(v, low, high), "an integer" + bounds)

    def number(self, key: str, *, low: float | None = None, high: float | None = None, default: Any = _MISSING) -> Any:
        """A finite number (an integer or a float, not a boolean) in ``[low, high]``."""

        def fits(value: Any) -> bool:
            finite = isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < float("inf")
            return finite and _within(value, low, high)

        return self._take(key, default, fits, f"a number in [{low}, {high}]")

    def string(self, key: str, *, default: Any = _MISSING, choices: Iterable[str] | None = None) -> Any:
        """A string; one of ``choices`` when given."""
        if choices is None:
            return self._take(key, default, lambda v: isinstance(v, str), "a string")
        allowed = sorted(choices)
        return self._take(key, default, lambda v: isinstance(v, str) and v in allowed, f"one of {', '.join(allowed)}")

    def boolean(self, key: str, *, default: Any = _MISSING) -> Any:
        return self._take(key, default, lambda v: isinstance(v, bool), "true or false")

    def mapping(self, key: str, *, default: Any = _MISSING) -> Any:
        """A JSON object (returned as the dict)."""
        return self._take(key, default, lambda v: isinstance(v, dict), "an object")

    def sequence(self, key: str, *, default: Any = _MISSING) -> Any:
        """A JSON list."""
        return self._take(key, default, lambda v: isinstance(v, list), "a list")

    def nested(self, key: str) -> Fields:
        """The fields of the object under ``key``, with messages naming ``key.field``."""
        return Fields(self.mapping(key), self.where, f"{self.prefix}{key}.")

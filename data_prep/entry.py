"""How every command line of the project starts and ends (``launch/*.py``, ``python -m data_prep.cli``,
``python -m pipeline.cli.<name>``): `run` calls the command's ``main`` and exits with its status, handling a
standard output that does not take what the command prints.

- A closed pipe (``launch/eval.py ... | head -1``: the reader has what it wanted) ends the command quietly, with
  status 141, which is 128 + SIGPIPE: what a shell reports for a program a closed pipe stopped, so ``set -o
  pipefail`` still sees that the output was cut.
- Any other failed write (``> /dev/full``, a full disk, a quota) is one line on stderr naming standard output,
  where it points and the error, status 1: never 0 with output lost.

A working directory that was removed after the shell entered it is refused in one line, status 2, when this
module is imported: every launch script imports it first, because importing torch in a removed directory ends the
process inside oneMKL before any of the command's own code runs.

Python would show either as a traceback, or, when the write fails in the final flush at exit, as an "Exception
ignored" message and status 120. `run` flushes standard output itself before it exits, and only failed writes to
standard output are handled: it replaces ``sys.stdout`` by a stream whose failed writes raise `StdoutError`, so
that a full disk met while writing a result file keeps its own report, which names that file. This lives in
``data_prep`` because prep's command goes through it and may not import the pipeline.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["CLOSED_PIPE_EXIT", "StdoutError", "run", "working_directory_problem"]

CLOSED_PIPE_EXIT = 128 + 13
"""The exit status after standard output turned out to be a closed pipe (128 + SIGPIPE, as a shell reports it)."""


def working_directory_problem() -> str | None:
    """Why the command cannot start where it stands (its working directory was removed), or None."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return (
            "the working directory no longer exists (it was removed after the shell entered it); cd to a directory "
            "that exists and run the command again"
        )
    return None


if (_GONE := working_directory_problem()) is not None:
    print(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {_GONE}", file=sys.stderr)
    sys.exit(2)


class StdoutError(OSError):
    """A write to standard output failed (its errno is the system's: EPIPE for a closed pipe, ENOSPC, ...)."""


class _StdoutFile(io.FileIO):
    """Standard output's descriptor, whose first failed write raises `StdoutError`; after it, writes are dropped
    (the command's output is lost anyway, and Python's flush at exit must not fail again) and `failed` holds it."""

    failed: StdoutError | None = None

    def write(self, data: object) -> int | None:  # type: ignore[override]
        if self.failed is not None:
            return len(data)  # type: ignore[arg-type]
        try:
            return super().write(data)  # type: ignore[arg-type]
        except OSError as err:
            self.failed = StdoutError(err.errno, err.strerror)
            raise self.failed from None


def _guarded(stream: io.TextIOWrapper) -> tuple[io.TextIOWrapper, _StdoutFile]:
    """A text stream like ``stream`` (encoding, error handler, buffering: none under ``python -u`` or
    ``PYTHONUNBUFFERED``) over a `_StdoutFile` of its descriptor, and that file."""
    stream.flush()
    raw = _StdoutFile(stream.fileno(), "w", closefd=False)
    text = io.TextIOWrapper(
        raw if isinstance(stream.buffer, io.FileIO) else io.BufferedWriter(raw),
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=stream.line_buffering,
        write_through=stream.write_through,
    )
    return text, raw


def _status_after(err: StdoutError) -> int:
    """The exit status after a failed write to standard output; anything but a closed pipe is said in one line."""
    if err.errno == errno.EPIPE:
        return CLOSED_PIPE_EXIT
    try:
        target = os.readlink("/proc/self/fd/1")  # a file's path, /dev/full, pipe:[...]
    except OSError:
        target = "?"
    program = os.path.basename(sys.argv[0]) or "python"
    print(
        f"{program}: error: cannot write to standard output ({target}): {err.strerror} (errno {err.errno}); "
        "what the command printed is incomplete",
        file=sys.stderr,
    )
    return 1


def run(main: Callable[[], int | None]) -> NoReturn:
    """Call ``main`` and exit with the status it returns (or raises as ``SystemExit``: argparse's ``--help``,
    ``--keys`` and usage errors), after flushing standard output; a closed or failed standard output as the module
    docstring says, also when ``main`` caught the error itself and went on."""
    stdout = None
    if isinstance(sys.stdout, io.TextIOWrapper):  # not, when the caller replaced it (nothing to guard then)
        sys.stdout, stdout = _guarded(sys.stdout)
    status: int | str | None
    try:
        try:
            status = main()
        except SystemExit as stop:
            status = stop.code
        sys.stdout.flush()
    except StdoutError:
        pass  # stdout.failed holds it
    if stdout is not None and stdout.failed is not None:
        status = _status_after(stdout.failed)
    sys.exit(status)

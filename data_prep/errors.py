"""Errors that `launch/prep.py` reports as one line (no traceback): they describe bad input, not bugs."""

from data_prep import schema
from data_prep.redaction import redact

__all__ = ["ConfigError", "InputError", "OutputExistsError", "OutputWriteError", "PrepError"]


class PrepError(Exception):
    """Base class; the message names the offending file, key or value and, where possible, the fix.

    The message is redacted when the error is made: it may quote config values that came from the environment,
    and it is printed, logged and shown by test runners in more places than `launch/prep.py` controls.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class ConfigError(PrepError, schema.ConfigError):
    """An unknown key, a bad value, or a missing required key in the prep config, or settings that do not fit the
    input or output. A prep error like the others here, and the shared config error, which every tool catches."""


class InputError(PrepError):
    """Input that cannot be read: no files matched, an unknown format, a malformed record under strict."""


class OutputExistsError(PrepError, FileExistsError):
    """The output exists and may not be replaced: ``overwrite=true`` was not given, or the directory is not a
    dataset prep wrote (so replacing it could delete someone's files)."""


class OutputWriteError(PrepError):
    """The output cannot be written: its parent is not writable, or the disk filled up during the run."""

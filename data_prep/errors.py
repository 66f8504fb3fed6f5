"""Errors that `launch/prep.py` reports as one line (no traceback): they describe bad input, not bugs."""

__all__ = ["ConfigError", "InputError", "OutputExistsError", "PrepError"]


class PrepError(Exception):
    """Base class; the message names the offending file, key or value and, where possible, the fix."""


class ConfigError(PrepError, ValueError):
    """An unknown key, a bad value, or a missing required key in the prep config."""


class InputError(PrepError):
    """Input that cannot be read: no files matched, an unknown format, a malformed record under strict."""


class OutputExistsError(PrepError, FileExistsError):
    """The output directory exists and ``overwrite=true`` was not given."""

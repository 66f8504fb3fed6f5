"""Keep values from the environment and known secret shapes out of everything the project prints or writes.

Configs may take values from the environment with ``${oc.env:NAME}``. Whatever the variable is called, such a
value can be a credential (a bucket URL with a key in it, a token in a wandb project name), and every config the
project loads ends up in logs, ``config.yaml``, checkpoints, manifests and result files. So:

- ``track_env_values()`` makes OmegaConf's ``oc.env`` resolver record each value it hands out;
- config files are written with ``restore_env_interpolations``: an environment-derived node is stored as its
  ``${oc.env:NAME}`` text, which keeps the file re-runnable and the value out of it;
- ``redact`` / ``redact_tree`` / the log filter replace, in free text, every recorded environment value (as
  ``${oc.env:NAME}``), the value of every secret-named environment variable (``WANDB_API_KEY``, ``HF_TOKEN``, ...,
  as ``<redacted:NAME>``) and known secret shapes (Hugging Face, AWS, GitHub, Slack and OpenAI-style tokens, JWTs,
  private-key blocks, passwords in URLs, as ``<redacted>``).

``GCA_SHOW_ENV_VALUES=1`` shows environment-derived values again (for debugging a config); secret-named variables
and secret shapes stay redacted whatever it says. This module lives in ``data_prep`` because both data prep and
the pipeline write configs, and ``data_prep`` may not import the pipeline.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

REVEAL_ENV = "GCA_SHOW_ENV_VALUES"
"""Set to 1 to print and write values that came from ``${oc.env:...}`` as they are."""

REDACTED = "<redacted>"

_MIN_FREE_TEXT_LEN = 4
"""Shorter environment values ("1", "cpu") are too common to hunt in free text, and too short to be secrets; config
files still store them as their interpolation."""

_MIN_SECRET_LEN = 8
"""A secret-named variable with a shorter value (``HF_TOKEN=1``, a flag) is not a credential worth redacting."""

_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}
"""Words of an environment variable or config key name (split at ``_`` and other non-word characters) that mark a
secret: WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, GITHUB_TOKEN, ... (not TOKENIZERS_PARALLELISM)."""

_SECRET_SHAPES = re.compile(
    "|".join(
        (
            r"\bhf_[A-Za-z0-9]{30,}",  # Hugging Face access token
            r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",  # AWS access key id
            r"\bgh[pousr]_[A-Za-z0-9]{30,}",  # GitHub tokens
            r"\bgithub_pat_[A-Za-z0-9_]{22,}",
            r"\bxox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
            r"\bsk-[A-Za-z0-9_-]{20,}",  # OpenAI-style API keys
            r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JWT
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
        )
    )
)
_URL_PASSWORD = re.compile(r"(?<=://)([^/\s:@]+):([^/\s@]+)(?=@)")

_env_values: dict[str, str] = {}
"""Every value ``oc.env`` resolved in this process -> the variable it came from."""


def is_secret_name(name: str) -> bool:
    """Whether a variable or key name reads like a credential (``HF_TOKEN``, ``wandb.api_key``)."""
    return bool(set(re.split(r"[_\W]+", name.lower())) & _SECRET_WORDS)


def track_env_values() -> None:
    """Replace OmegaConf's ``oc.env`` resolver by one that also records the values it returns (idempotent).

    Call before resolving a config; values resolved earlier are not known to ``redact``.
    """
    from omegaconf import OmegaConf
    from omegaconf.resolvers import oc

    def env(key: str, *default: Any) -> Any:
        value = oc.env(key, *default)
        if isinstance(value, str) and value:
            _env_values[value] = key
        return value

    OmegaConf.register_resolver("oc.env", env, replace=True, annotation_validation="off")


def _reveal_env() -> bool:
    return os.environ.get(REVEAL_ENV, "") == "1"


def reveal_env_problem() -> str | None:
    """What is wrong with the value of `REVEAL_ENV`, if anything: only 1 shows, so a "yes" or "true" would go on
    hiding without a word. Checked with every config (``data_prep.schema.load_schema``), before any work."""
    value = os.environ.get(REVEAL_ENV, "")
    if value in ("", "0", "1"):
        return None
    return f"{REVEAL_ENV}={value!r} must be 1 (show values taken from the environment) or 0 (hide them, as when unset)"


def _bounded(value: str) -> str:
    """A pattern for ``value``; a short one must not match inside a longer word ("test" in "pytest"), a long one
    (``_MIN_SECRET_LEN`` and up) matches anywhere, also joined to other text (``${oc.env:DIR}x``)."""
    if len(value) >= _MIN_SECRET_LEN:
        return re.escape(value)
    left = r"(?<![A-Za-z0-9])" if value[0].isalnum() else ""
    right = r"(?![A-Za-z0-9])" if value[-1].isalnum() else ""
    return left + re.escape(value) + right


def _secret_env_values() -> dict[str, str]:
    """Value -> name of every secret-named environment variable long enough to be a credential."""
    return {value: name for name, value in os.environ.items() if is_secret_name(name) and len(value) >= _MIN_SECRET_LEN}


def _replacements() -> list[tuple[str, str]]:
    """(value, replacement) pairs, longest value first so a value inside another is not replaced half-way."""
    pairs: dict[str, str] = {}
    if not _reveal_env():
        pairs.update({v: f"${{oc.env:{k}}}" for v, k in _env_values.items() if len(v) >= _MIN_FREE_TEXT_LEN})
    pairs.update({value: f"<redacted:{name}>" for value, name in _secret_env_values().items()})
    return sorted(pairs.items(), key=lambda item: -len(item[0]))


def find_secret(text: str) -> str | None:
    """What secret ``text`` holds, described without its value: the value of a secret-named environment variable
    (named), or a value shaped like a credential; None when it holds neither."""
    for value, name in _secret_env_values().items():
        if value in text:
            return f"the value of the environment variable {name}"
    if _SECRET_SHAPES.search(text) or _URL_PASSWORD.search(text):
        return "what looks like a credential (an access token, or a password in a URL)"
    return None


def _constant(replacement: str) -> Callable[[re.Match[str]], str]:
    return lambda _: replacement


def redact(text: str) -> str:
    """``text`` with environment-derived values, secret-named variables' values and secret shapes replaced."""
    for value, replacement in _replacements():
        if value in text:
            # A plain string replacement would be read as a regex template (its backslashes); a function is not.
            text = re.sub(_bounded(value), _constant(replacement), text)
    text = _SECRET_SHAPES.sub(REDACTED, text)
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{REDACTED}", text)


def redact_tree(obj: Any) -> Any:
    """``redact`` applied to every string (keys included) of nested dicts, lists and tuples; a new object."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_tree(k): redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_tree(v) for v in obj)
    return obj


def _walk(node: Any, path: tuple[str, ...], out: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _walk(value, (*path, str(key)), out)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _walk(value, (*path, str(i)), out)
    elif isinstance(node, str) and "oc.env" in node:
        out[".".join(path)] = node


def raw_env_paths(raw: Any) -> dict[str, str]:
    """Dotted path (list items by index: ``a.b.0``) -> raw text, for every node of an unresolved container
    (``OmegaConf.to_container(cfg, resolve=False)``) whose text reads the environment."""
    out: dict[str, str] = {}
    _walk(raw, (), out)
    return out


def restore_env_interpolations(resolved: Any, env_paths: dict[str, str]) -> Any:
    """A copy of ``resolved`` (nested dicts/lists) in which every node named in ``env_paths`` holds its raw
    ``${oc.env:...}`` text again, so a config file written from it neither holds nor loses the value.

    Paths missing from ``resolved`` (a key the schema dropped) are ignored. ``GCA_SHOW_ENV_VALUES=1`` keeps values.
    """
    if _reveal_env() or not env_paths:
        return resolved

    def rebuild(node: Any, path: tuple[str, ...]) -> Any:
        dotted = ".".join(path)
        if path and dotted in env_paths:
            return env_paths[dotted]
        if isinstance(node, dict):
            return {k: rebuild(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(rebuild(v, (*path, str(i))) for i, v in enumerate(node))
        return node

    return rebuild(resolved, ())


class RedactingFilter(logging.Filter):
    """Redacts a log record's message, exception text and stack before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def _redacting_excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(kind, exc, tb))))


def install_log_redaction() -> None:
    """Add a ``RedactingFilter`` to every handler of the root logger (idempotent; call again after adding
    handlers) and make uncaught exceptions print redacted."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    sys.excepthook = _redacting_excepthook

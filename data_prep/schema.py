"""One way to load a config: a YAML file plus ``key=value`` overrides into a typed dataclass schema.

Data prep, training, evaluation and the demo all load their settings through `load_schema`, so every tool reports a
bad config the same way: one `ConfigError` line naming the file or override, the full key and the value. In order:
the working directory and ``GCA_SHOW_ENV_VALUES`` are checked (a removed directory, a value other than 0 or 1:
named), the file is read (a regular file or a pipe such as ``<(...)``; missing, a directory or a device, too large,
not UTF-8, not YAML, not a mapping: named), each layer's keys are checked against the schema (an unknown key gets a
near-miss suggestion and the known keys; an override that is not UTF-8 is named), the layers are merged onto the
schema in order (a wrong type names the key and where the value came from), and the dataclass is built (a missing
required value, or a rule of the schema's own ``__post_init__``, is an error too).

Values may read the environment (``${oc.env:NAME}``); errors show the interpolation, never the value (see
``data_prep.redaction``), and the loader returns where each such interpolation sits so that whatever writes the
config out can keep the interpolation. The module lives in ``data_prep`` because both data prep and the pipeline
load configs, and ``data_prep`` may not import the pipeline.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import os
import re
import stat
import textwrap
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException, ValidationError

from data_prep.entry import working_directory_problem
from data_prep.redaction import raw_env_paths, redact, reveal_env_problem, track_env_values
from data_prep.safe_files import file_kind

__all__ = ["INTERNAL", "ConfigError", "add_keys_argument", "describe_keys", "load_schema", "not_utf8"]

T = TypeVar("T")

INTERNAL = {"internal": True}
"""Field metadata: set by the program, never by a user (a config naming it is rejected as an unknown key)."""

MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""The tools' configs are a few KB; a larger one is not a config, and a pipe that never ends must not fill memory."""
PIPE_WRITER_WAIT_S = 2.0
"""How long a config pipe may stay without a writer (see `_first_pipe_chunk`): a writer started alongside the
command (``--config <(...)``, ``cat x > fifo &``) connects within milliseconds."""


class ConfigError(ValueError):
    """A config that cannot be used: the message names the file or override, the full key and the value.

    The message is redacted when the error is made: it may quote values that came from the environment or hold a
    secret, and it is printed, logged and shown by test runners in more places than any one tool controls.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


def quote_hint(key: str) -> str:
    """How to write text that YAML would otherwise read as something else (a mapping, a list, a number)."""
    return (
        f"values are read as YAML, so quote text with spaces, braces or colons: '{key}=\" text: {{x}}\"' "
        f'on the command line, {key}: " text: {{x}}" in a config file'
    )


Derive = Callable[[DictConfig, Mapping[str, str]], Mapping[str, Any]]
"""``derive`` of `load_schema`: (merged config, dotted key -> the layer that set it) -> dotted key -> value."""


def load_schema(
    schema: type[T], path: str | Path | None, overrides: Sequence[str], *, what: str, derive: Derive | None = None
) -> tuple[T, dict[str, str]]:
    """The YAML file at ``path`` (if any) with ``overrides`` applied in order, as an instance of ``schema``.

    Args:
        schema: a dataclass whose fields (nested dataclasses included) are the config keys.
        path: YAML file holding a mapping of keys, or None to start from the schema's defaults.
        overrides: ``key=value`` strings (dotted keys for nested fields); each value is read as YAML.
        what: what the keys configure (``prep``, ``train``, ``eval``, ``demo``), for the messages.
        derive: values that follow from other values (a checkpoint's shapes), set after the layers are merged and
            before the dataclass is built, so its own rules see them. It gets the merged config and the keys the
            file or an override set (a key absent there holds its schema default): only the merged tree knows
            that, the built dataclass cannot tell a default from the same value written out. It may raise
            ``ConfigError``.

    Returns:
        The instance, and dotted key -> raw ``${oc.env:...}`` text of every value that came from the environment.

    Raises:
        ConfigError: the file, an override, a key or a value is wrong; the message names it.
    """
    _check_working_directory()
    if (problem := reveal_env_problem()) is not None:
        raise ConfigError(problem)
    track_env_values()  # before anything resolves: every ${oc.env:...} value is then known to `redact`
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        layers.append((f"config file {path}", _read_yaml(Path(path), what)))
    # An override is named by its key only: the value may be a secret that no redaction rule knows.
    layers += [(f"override '{item.partition('=')[0]}=...'", _parse_override(item, schema)) for item in overrides]
    merged = OmegaConf.structured(schema)
    origins: dict[str, str] = {}
    for source, layer in layers:
        _check_keys(layer, schema, "", source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _explain(err, schema, source) from None
        origins.update(dict.fromkeys(_leaf_keys(layer), source))
    for derived, value in (derive(merged, origins) if derive is not None else {}).items():
        OmegaConf.update(merged, derived, value, merge=False)
    env_paths = raw_env_paths(OmegaConf.to_container(merged, resolve=False))
    try:
        built = OmegaConf.to_object(merged)
    except MissingMandatoryValue as err:
        key = err.full_key
        raise ConfigError(
            f"config key '{key}' is required: set it in the {what} config file or pass {key}=..."
        ) from None
    except OmegaConfBaseException as err:
        raise _explain(err, schema, _origin(origins, err.full_key)) from None
    except ValueError as err:  # a rule of the schema's own __post_init__ (e.g. model.config.ConfigError)
        raise ConfigError(str(err)) from None
    assert isinstance(built, schema)
    return built, env_paths


def _check_working_directory() -> None:
    """Refuse to start in a working directory that was removed: every relative path of the config would name
    nothing, and the first look at one would be a bare ``FileNotFoundError`` naming no path."""
    if (problem := working_directory_problem()) is not None:
        raise ConfigError(problem)


def _read_yaml(path: Path, what: str) -> DictConfig:
    """The file as a mapping of keys; anything else is one line naming the file and what is wrong."""
    try:
        text = _read_config_bytes(path, what).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text; a config file is YAML") from None
    try:
        top = yaml.safe_load(text)  # the top-level type, before omegaconf reinterprets a scalar
        if top is None:
            return OmegaConf.create({})
        if not isinstance(top, dict):
            kind = "list" if isinstance(top, list) else "single value"
            raise ConfigError(
                f"config file {path}: the top level must be a mapping of {what} keys, not a {kind}; "
                "write lines like 'key: value'"
            )
        loaded = OmegaConf.create(text)  # omegaconf's YAML reading (1e-3 is a float) for the values
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path}: not valid YAML ({_yaml_problem(err)})") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"config file {path}: {_first_line(err)}") from None
    assert isinstance(loaded, DictConfig), "a YAML mapping loads as a DictConfig"
    return loaded


def _read_config_bytes(path: Path, what: str) -> bytes:
    """The bytes of a config: a regular file, or a pipe (``--config <(sed ... base.yaml)`` passes ``/dev/fd/63``),
    at most `MAX_CONFIG_BYTES`; a directory, a device or a socket is refused for what it is, before it is opened
    (reading ``/dev/zero`` would never end)."""
    try:
        kind = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"config file not found: {path} (expected a YAML file of {what} keys)") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read ({err.strerror or err})") from None
    if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind)):
        raise ConfigError(f"config file {path}: {file_kind(kind)}, not a YAML file of {what} keys")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open waits for no writer
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read ({err.strerror or err})") from None
    try:
        chunks = [_first_pipe_chunk(fd, path)] if stat.S_ISFIFO(kind) else []
        os.set_blocking(fd, True)  # then read what the writer writes, as long as it takes, as `cat` would
        size = sum(map(len, chunks))
        while size <= MAX_CONFIG_BYTES and (chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read ({err.strerror or err})") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: more than {MAX_CONFIG_BYTES:,} bytes; a config file is a few keys")
    return b"".join(chunks)


def _first_pipe_chunk(fd: int, path: Path) -> bytes:
    """The first bytes of a pipe opened without blocking, or b"" once a writer is there with nothing written yet.

    A read without a writer ends at once with nothing: a named FIFO no program writes to (whose blocking open would
    wait forever), a writer not yet started, or a pipe whose writer wrote nothing. Each is given
    `PIPE_WRITER_WAIT_S` to change before the pipe is refused."""
    deadline = time.monotonic() + PIPE_WRITER_WAIT_S
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:  # a writer holds the pipe: what it writes is read blocking
            return b""
        if chunk:
            return chunk
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"config file {path}: a pipe that nothing was written to within {PIPE_WRITER_WAIT_S:g} s (a FIFO no "
                "program writes to, or a command that printed nothing); a config file is YAML"
            )
        time.sleep(0.05)


def _parse_override(item: str, schema: type) -> DictConfig:
    """One ``key=value`` as a config tree; the key is checked before the value is parsed."""
    _check_utf8(item)
    key, sep, _ = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    _check_dotted_key(key, schema, f"override '{key}=...'")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: not a valid value ({_yaml_problem(err)}); {quote_hint(key)}") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"override {item!r}: {_first_line(err)}") from None


def not_utf8(text: str) -> str | None:
    """Where an argument stops being UTF-8 text ("byte 0xe9 at position 3"), None when it is all text: Python hands
    a program's argument bytes that are not UTF-8 over as lone surrogates (``os.fsdecode``), which no UTF-8 file,
    parser or tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = ord(text[err.start])
        what = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        return f"{what} at position {err.start}"
    return None


def _check_utf8(item: str) -> None:
    """Refuse an override that is not UTF-8: a config value is text, and every file that records it (the written
    config, the manifest, the logs) is UTF-8. The message names the key only, like any other override error."""
    if (bad := not_utf8(item)) is not None:
        key = item.partition("=")[0].encode("utf-8", "backslashreplace").decode("ascii")
        raise ConfigError(
            f"override '{key}=...': {bad} is not UTF-8 text; config values are UTF-8 (rename a path whose name is not)"
        )


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and where."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark
        return f"{err.problem}" + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark else "")
    return (str(err).splitlines() or [type(err).__name__])[0]


def _first_line(err: OmegaConfBaseException) -> str:
    text = str(getattr(err, "msg", None) or err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# -- the schema's keys ----------------------------------------------------------------------------------------------


def _user_fields(cls: type) -> dict[str, Any]:
    """Field name -> type hint of every field a config may set."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _without_none(hint: Any) -> Any:
    """``X`` for ``X | None``; other hints as they are."""
    if get_origin(hint) in (Union, types.UnionType):
        rest = [arg for arg in get_args(hint) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _section(hint: Any) -> type | None:
    """The dataclass a field holds (a nested section), or None."""
    hint = _without_none(hint)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _item_section(hint: Any) -> type | None:
    """The dataclass each item of a list field holds, or None."""
    hint = _without_none(hint)
    return _section(get_args(hint)[0]) if get_origin(hint) is list and get_args(hint) else None


def _unknown(key: str, prefix: str, known: dict[str, Any], source: str) -> ConfigError:
    near = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else ""
    where = f"known keys under '{prefix.rstrip('.')}'" if prefix else "known keys"
    return ConfigError(f"unknown config key '{prefix}{key}'{hint} (in {source}; {where}: {', '.join(sorted(known))})")


def _check_dotted_key(dotted: str, schema: type, source: str) -> None:
    """A dotted override key names a field at every level that is a section."""
    section: type | None = schema
    prefix = ""
    for part in dotted.split("."):
        if section is None:
            return  # below a leaf or a free-form mapping: the merge judges the value
        known = _user_fields(section)
        if part not in known:
            raise _unknown(part, prefix, known, source)
        section, prefix = _section(known[part]), f"{prefix}{part}."


def _check_keys(node: DictConfig, cls: type, prefix: str, source: str) -> None:
    """Every key of ``node`` is a field of ``cls``, at every depth; a section holds a mapping.

    A single value for a list of values stands for the list of that one value (``lengths=1024`` is
    ``lengths=[1024]``, ``input: corpus.txt`` is ``input: [corpus.txt]``), as a user writing one value means; it
    becomes a one-item list here, keeping its raw text (an ``${oc.env:...}`` value stays an interpolation). A
    list of sections (``parts: [{name: a}]``) takes no single value: its items are mappings.
    """
    known = _user_fields(cls)
    for raw_key in list(node.keys()):
        key = str(raw_key)
        if key not in known:
            raise _unknown(key, prefix, known, source)
        full = f"{prefix}{key}"
        child = node._get_node(key)
        section, item_section = _section(known[key]), _item_section(known[key])
        if section is not None and child is not None and not child._is_none():
            if not isinstance(child, DictConfig):
                raise ConfigError(f"config key '{full}' must be a mapping of keys (in {source}); got {child!r}")
            _check_keys(child, section, f"{full}.", source)
        elif get_origin(_without_none(known[key])) is list and isinstance(child, DictConfig):
            raise ConfigError(f"config key '{full}' has a wrong value (in {source}): a list is expected, got a mapping")
        elif item_section is not None and isinstance(child, ListConfig):
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    _check_keys(item, item_section, f"{full}[{i}].", source)
        elif child is None or isinstance(child, ListConfig) or child._is_none():
            pass
        elif item_section is not None:
            raise ConfigError(
                f"config key '{full}' has a wrong value (in {source}): a list of mappings is expected, like "
                f"{full}=[{{key: value}}]"
            )
        elif get_origin(_without_none(known[key])) is list:
            raw = OmegaConf.to_container(node, resolve=False)
            assert isinstance(raw, dict)
            node[key] = [raw[key]]


def _leaf_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys of every value set in a layer (a list counts as one value)."""
    out: list[str] = []
    for key in map(str, node.keys()):
        child = node._get_node(key)
        full = f"{prefix}{key}"
        out += _leaf_keys(child, f"{full}.") if isinstance(child, DictConfig) else [full]
    return out


def _origin(origins: dict[str, str], key: str | None) -> str | None:
    """The layer that set ``key`` (or the nearest section above it), or None for a schema default."""
    parts = re.split(r"[.\[]", key or "")
    for end in range(len(parts), 0, -1):
        found = origins.get(".".join(parts[:end]))
        if found is not None:
            return found
    return None


def _leaf_hint(schema: type, key: str) -> Any:
    """The type hint of the field at dotted ``key`` (list items as ``key[i]``), or None when not a field."""
    hint: Any = schema
    for part in key.split("."):
        name = part.split("[")[0]
        section = _section(hint) or _item_section(hint)
        if section is None or name not in _user_fields(section):
            return None
        hint = _user_fields(section)[name]
    return hint


def _explain(err: OmegaConfBaseException, schema: type, source: str | None) -> ConfigError:
    """The merge or build error as one line naming the key, where its value came from and what is wrong."""
    key = err.full_key or ""
    where = f" (in {source})" if source else ""
    reason = _first_line(err)
    if not key:
        return ConfigError(f"config{where}: {reason}")
    if not isinstance(err, ValidationError):
        return ConfigError(f"config key '{key}'{where}: {reason}")
    text_field = _without_none(_leaf_hint(schema, key)) is str
    return ConfigError(
        f"config key '{key}' has a wrong value{where}: {reason}" + (f"; {quote_hint(key)}" if text_field else "")
    )


# -- listing the keys (``--keys``) ----------------------------------------------------------------------------------


def describe_keys(schema: type) -> str:
    """Every key a config of ``schema`` may set, as text: ``key (type) = default``, then its docstring indented.

    Nested sections are walked and their keys written dotted (``tokenizer.vocab_size``), each section introduced by
    its own docstring; fields marked `INTERNAL` are left out. The docstrings are the attribute docstrings of the
    schema's source (a string literal right after a field), found in the class that declares the field, so fields
    inherited from a base dataclass keep theirs. A ``default_factory`` default is shown as the value it makes, a
    field without a default as ``(required)``; values are written as they would be in a config (JSON, which YAML
    reads alike: ``null``, ``true``, ``"text"``).
    """
    lines = [
        f"Config keys of {schema.__name__} (set in the --config YAML file or as key=value overrides; "
        "the keys of a [section] are dotted: section.key=value):",
        "",
    ]
    _describe(schema, "", lines)
    return "\n".join(lines).rstrip() + "\n"


def add_keys_argument(parser: argparse.ArgumentParser, schema: type) -> None:
    """Give ``parser`` a ``--keys`` option that prints `describe_keys` of ``schema`` and exits 0.

    Like ``--help`` it acts while the command line is parsed, so no other work is done and the required options
    (``--config``, ``--checkpoint``, ...) are not needed with it; without it they stay required.
    """

    class _KeysAction(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
            print(describe_keys(schema), end="")
            parser.exit(0)

    parser.add_argument(
        "--keys",
        action=_KeysAction,
        nargs=0,
        help=f"print every config key ({schema.__name__}) with its meaning and default, then exit",
    )


def _describe(cls: type, prefix: str, lines: list[str]) -> None:
    hints = _user_fields(cls)
    docs = _field_docs(cls)
    leaves = [f for f in dataclasses.fields(cls) if f.name in hints]
    # The plain keys of a section first, then its subsections, so that a subsection's keys stay together.
    sections = [f for f in leaves if _section(hints[f.name]) is not None]
    for f in (f for f in leaves if _section(hints[f.name]) is None):
        lines.append(f"{prefix}{f.name} ({_type_text(hints[f.name])}) = {_default_text(f)}")
        lines += _indented(docs.get(f.name))
        lines.append("")
    for f in sections:
        section = _section(hints[f.name])
        assert section is not None
        lines.append(
            f"[{prefix}{f.name}]" + ("" if _default_text(f) != "null" else " (optional section, default null)")
        )
        lines += _indented(docs.get(f.name) or _class_doc(section))
        lines.append("")
        _describe(section, f"{prefix}{f.name}.", lines)


def _indented(doc: str | None) -> list[str]:
    return ["    " + line if line else "" for line in (doc or "").splitlines()]


def _type_text(hint: Any) -> str:
    """``int``, ``str | None``, ``list[int]``, ``Literal['bpe', 'unigram']``."""
    if isinstance(hint, type) and not get_args(hint):
        return hint.__name__
    return re.sub(r"\b(typing|collections\.abc)\.", "", str(hint)).replace("NoneType", "None")


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, str) and value == "???":  # omegaconf's MISSING
        return "(required)"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


@functools.cache
def _class_source(cls: type) -> ast.ClassDef | None:
    """The class statement of ``cls`` as parsed from its source, or None when the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.ClassDef) else None


def _class_doc(cls: type) -> str | None:
    node = _class_source(cls)
    return ast.get_docstring(node) if node is not None else None  # not __doc__: dataclass makes one up


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> attribute docstring, from ``cls`` and its base classes (the class that declares a field wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        node = _class_source(klass) if dataclasses.is_dataclass(klass) else None
        if node is None:
            continue
        for stmt, after in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs

"""``EvalConfig``: the keys of ``launch/eval.py`` (``key=value`` overrides on an optional YAML), validated once."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data_prep.redaction import raw_env_paths, redact, track_env_values
from pipeline.evaluation.passkey import VARIANTS, NeedleSpec, check_templates
from pipeline.evaluation.runtime import check_device

TASKS = ("ppl", "passkey")


@dataclass
class EvalConfig:
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    """Sequence lengths in tokens (each at least one chunk)."""
    data: str = "builtin"
    """Token source: builtin | stdlib | an MDS split | a prepared dataset dir (val) | text file(s) | a dir."""
    samples: int = 4
    """ppl: windows per length; passkey: samples per (length, depth)."""
    seed: int = 0
    segment: int = 4096
    """Tokens per forward_stream call: bounds activation memory, any value gives the same logits."""
    device: str = "cpu"
    attn_backend: str | None = None
    """Override the export's GCA backend (naive | triton | auto)."""
    offload_mb: int = 1024
    """Chunk K/V kept in RAM per sequence before spilling to an on-disk memmap; -1 keeps everything in RAM."""
    offload_dir: str | None = None
    """Where the memmap temp dir goes (default: the system temp dir)."""
    progress: bool = True
    """Show tqdm progress bars (tokens/s)."""
    variant: str = "single"
    """passkey: single | multi | multihop."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """passkey: needle depths, fractions of the haystack before the key-bearing needle."""
    needle: str | None = None
    """passkey: needle template ({key}; multi/multihop also {name}); default per variant."""
    question: str | None = None
    """passkey: question template (multi/multihop: {name})."""
    answer: str | None = None
    """passkey: answer template ({key})."""
    link: str | None = None
    """passkey multihop: link template ({name}, {next})."""
    needles: int = 4
    """passkey multi: needles in the haystack; multihop: 2 x (needles // 2) in chains."""
    key_digits: int = 5
    """passkey: digits of the key."""


class EvalConfigError(ValueError):
    """A bad ``launch/eval.py`` key, value or file; the message names it. Values that came from the environment
    (``${oc.env:...}``) and secret shapes are redacted from the message."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


KNOWN_KEYS = tuple(f.name for f in fields(EvalConfig))
TEMPLATE_KEYS = ("needle", "question", "answer", "link")
QUOTE_HINT = (
    "values are read as YAML, so quote text with spaces, braces or colons: "
    '\'answer=" {key}"\' on the command line, answer: " {key}" in a --config file'
)
MAX_KEY_DIGITS = 18
"""Keys are drawn as int64: 10**19 no longer fits."""


def load_eval_config(path: str | None, overrides: list[str]) -> tuple[EvalConfig, dict[str, str]]:
    """YAML (optional) + ``key=value`` overrides -> ``(validated EvalConfig, env_paths)``; unknown keys are errors.

    ``env_paths`` maps every key whose text reads the environment (``${oc.env:NAME}``) to that text, for
    ``restore_env_interpolations`` when the config is written out.
    """
    track_env_values()  # before anything resolves, so every environment value is known to redact()
    merged = OmegaConf.structured(EvalConfig)
    layers = [_read_yaml(path)] if path else []
    layers += [_parse_override(item) for item in overrides]
    try:
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        env_paths = raw_env_paths(OmegaConf.to_container(merged, resolve=False))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        hint = f"; {QUOTE_HINT}" if err.full_key in TEMPLATE_KEYS else ""
        raise EvalConfigError(f"{err.full_key or 'config'}: {err.msg.splitlines()[0]}{hint}") from None
    assert isinstance(cfg, EvalConfig)
    validate(cfg)
    return cfg, env_paths


def _parse_override(item: str) -> DictConfig:
    """One ``key=value`` (the value read as YAML, like OmegaConf's dotlist) for a known key."""
    if "=" not in item:
        raise EvalConfigError(f"override {item!r} must look like key=value")
    key, value = item.split("=", 1)
    _check_key(key, "")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:
        raise EvalConfigError(f"{key}={value!r}: not a valid value ({_yaml_problem(err)}); {QUOTE_HINT}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and where."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark
        return f"{err.problem}" + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark else "")
    return str(err).splitlines()[0]


def _check_key(key: str, where: str) -> None:
    if key not in KNOWN_KEYS:
        hint = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
        raise EvalConfigError(
            f"{where}unknown key {key!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; known keys: {', '.join(KNOWN_KEYS)}"
        )


def _read_yaml(path: str) -> DictConfig:
    """The ``--config`` file as a mapping of known eval keys, or one line naming the file and what is wrong."""
    if not Path(path).is_file():
        raise EvalConfigError(f"config file not found: {path} (--config takes a YAML file of eval keys)")
    try:
        node = OmegaConf.load(path)
    except UnicodeDecodeError:
        raise EvalConfigError(f"config file {path}: not UTF-8 text; --config takes a YAML file") from None
    except yaml.YAMLError as err:
        raise EvalConfigError(f"config file {path}: not valid YAML ({_yaml_problem(err)})") from None
    except OSError:  # OmegaConf raises it for a scalar top level
        node = None
    if not isinstance(node, DictConfig):
        raise EvalConfigError(
            f"config file {path}: the top level must be a mapping of eval keys (e.g. "
            "'lengths: [1024, 4096]'), not a list or a single value"
        )
    for key in node:
        _check_key(str(key), f"config file {path}: ")
    return node


def validate(cfg: EvalConfig, chunk_size: int | None = None) -> None:
    """Value rules, each naming the key and value; with ``chunk_size`` also "every length holds a chunk"."""
    if not cfg.lengths or any(n < 2 for n in cfg.lengths):
        raise EvalConfigError(f"lengths={cfg.lengths}: need at least one length, each >= 2")
    if chunk_size is not None and min(cfg.lengths) < chunk_size:
        raise EvalConfigError(
            f"lengths={cfg.lengths}: {min(cfg.lengths)} is below one chunk of the model "
            f"(chunk_size={chunk_size}); retrieval needs whole chunks"
        )
    for key in ("samples", "segment", "key_digits", "needles"):
        if getattr(cfg, key) < 1:
            raise EvalConfigError(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.key_digits > MAX_KEY_DIGITS:
        raise EvalConfigError(f"key_digits={cfg.key_digits} must be <= {MAX_KEY_DIGITS}")
    if cfg.seed < 0:
        raise EvalConfigError(f"seed={cfg.seed} must be >= 0")
    if cfg.offload_mb < -1:
        raise EvalConfigError(
            f"offload_mb={cfg.offload_mb} must be >= 0 (MiB of chunk K/V kept in RAM) or -1 (everything in RAM)"
        )
    if cfg.offload_dir is not None and not Path(cfg.offload_dir).is_dir():
        raise EvalConfigError(
            f"offload_dir={cfg.offload_dir!r} is not an existing directory; create it or leave "
            "it unset (the system temp dir)"
        )
    if cfg.variant not in VARIANTS:
        raise EvalConfigError(f"variant={cfg.variant!r} is not one of {VARIANTS}")
    if cfg.variant == "multihop" and cfg.needles < 2:
        raise EvalConfigError(f"needles={cfg.needles}: multihop needs >= 2 (a link and a key needle)")
    # NaN fails both comparisons, so it is refused here too.
    if not cfg.depths or any(not 0.0 <= d <= 1.0 for d in cfg.depths):
        raise EvalConfigError(f"depths={cfg.depths}: need at least one depth, each in [0, 1]")
    try:
        check_device(cfg.device)
        check_templates(needle_spec(cfg))
    except ValueError as err:
        raise EvalConfigError(str(err)) from None


def needle_spec(cfg: EvalConfig) -> NeedleSpec:
    """The passkey keys of ``cfg`` as the ``NeedleSpec`` the passkey task runs."""
    return NeedleSpec(cfg.variant, cfg.needle, cfg.question, cfg.answer, cfg.link, cfg.needles, cfg.key_digits)

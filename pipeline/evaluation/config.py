"""``EvalConfig``: the keys of ``launch/eval.py`` (``key=value`` overrides on an optional YAML), validated once."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.evaluation.passkey import VARIANTS

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
    """A bad ``launch/eval.py`` key or value; the message names it."""


def load_eval_config(path: str | None, overrides: list[str]) -> EvalConfig:
    """YAML (optional) + ``key=value`` overrides -> a validated ``EvalConfig``; unknown keys are errors."""
    merged = OmegaConf.structured(EvalConfig)
    if path and not Path(path).is_file():
        raise EvalConfigError(f"config file not found: {path}")
    layers = [OmegaConf.load(path)] if path else []
    for item in overrides:
        if "=" not in item:
            raise EvalConfigError(f"override {item!r} must look like key=value")
        key = item.split("=", 1)[0]
        known = [f.name for f in fields(EvalConfig)]
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise EvalConfigError(f"unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                  + f"; known keys: {', '.join(known)}")
    layers.append(OmegaConf.from_dotlist(overrides))
    try:
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise EvalConfigError(f"{err.full_key or 'config'}: {err.msg.splitlines()[0]}") from None
    assert isinstance(cfg, EvalConfig)
    validate(cfg)
    return cfg


def validate(cfg: EvalConfig, chunk_size: int | None = None) -> None:
    """Value rules; with ``chunk_size`` also "every length holds at least one chunk"."""
    if not cfg.lengths or any(n < 2 for n in cfg.lengths):
        raise EvalConfigError(f"lengths={cfg.lengths}: need at least one length, each >= 2")
    if chunk_size is not None and min(cfg.lengths) < chunk_size:
        raise EvalConfigError(f"lengths={cfg.lengths}: {min(cfg.lengths)} is below one chunk of the model "
                              f"(chunk_size={chunk_size}); retrieval needs whole chunks")
    for key in ("samples", "segment", "key_digits", "needles"):
        if getattr(cfg, key) < 1:
            raise EvalConfigError(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.variant not in VARIANTS:
        raise EvalConfigError(f"variant={cfg.variant!r} is not one of {VARIANTS}")
    if cfg.variant == "multihop" and cfg.needles < 2:
        raise EvalConfigError(f"needles={cfg.needles}: multihop needs >= 2 (a link and a key needle)")
    if not cfg.depths or any(not 0.0 <= d <= 1.0 for d in cfg.depths):
        raise EvalConfigError(f"depths={cfg.depths}: need at least one depth, each in [0, 1]")

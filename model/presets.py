"""Named model sizes shared by the benchmarks and the tests: ``preset(name, **overrides)``.

A caller that needs another value states it as an override, so each size is written once, here.
"""

from __future__ import annotations

from typing import Any

from model.config import ConfigError, GCAConfig

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256,
        d_model=64,
        n_heads=2,
        n_kv_heads=2,
        ffn_hidden=128,
        n_lower_layers=1,
        groups=[1],
        n_encoder_layers=1,
        chunk_size=16,
        top_k=2,
        window=32,
        gca_backend="naive",
        swa_backend="naive",
    ),
    "bench-eval": dict(
        vocab_size=512,
        d_model=128,
        n_heads=4,
        n_kv_heads=4,
        ffn_hidden=384,
        n_lower_layers=2,
        groups=[2],
        n_encoder_layers=1,
        chunk_size=16,
        top_k=4,
        window=64,
        gca_backend="naive",
        swa_backend="naive",
    ),
    "bench": dict(
        vocab_size=8192,
        d_model=256,
        n_heads=4,
        n_kv_heads=4,
        ffn_hidden=768,
        n_lower_layers=3,
        groups=[3],
        n_encoder_layers=1,
        chunk_size=63,
        top_k=8,
        window=512,
    ),
}
"""``tiny``: runs in milliseconds on CPU with the readable reference operators (byte-sized vocabulary; the tests'
model). ``bench-eval``: the passkey eval benchmark's random-init model (``make bench-eval``), reference operators.
``bench``: 8.6M parameters with the DRT's chunk 63 and top-8, default backends (``make bench``, ``make
bench-train``, ``make bench-cp``)."""


def preset(name: str, **overrides: Any) -> GCAConfig:
    """The ``GCAConfig`` of the preset ``name`` with ``overrides`` (any ``GCAConfig`` field) replacing its values."""
    if name not in PRESETS:
        raise ConfigError(f"no model preset {name!r}; the presets are {sorted(PRESETS)}")
    return GCAConfig(**{**PRESETS[name], **overrides})

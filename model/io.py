"""Model export for downstream jobs: ``model.safetensors`` + ``config.json``; nothing is ever unpickled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from model.config import GCAConfig
from model.baseline import build_model

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def save_pretrained(model: torch.nn.Module, directory: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write the model's config and fp32 weights to ``directory`` (created; files replaced atomically).

    ``extra`` (e.g. training length, tokenizer path) is stored under ``"export"`` in ``config.json``.
    """
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp_weights = directory / (WEIGHTS_NAME + ".tmp")
    save_model(model, str(tmp_weights), metadata={"format": "pt"})
    os.replace(tmp_weights, directory / WEIGHTS_NAME)
    payload = {"model": model.cfg.to_dict(), "export": extra or {}}
    tmp_config = directory / (CONFIG_NAME + ".tmp")
    tmp_config.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp_config, directory / CONFIG_NAME)
    return directory


def read_export_config(directory: str | os.PathLike) -> tuple[GCAConfig, dict]:
    """Return the model config and the ``export`` metadata of an export directory."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME}; is {directory} a model export directory?")
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(payload, dict) or "model" not in payload:
        raise ValueError(f"{path}: expected an object with a 'model' section")
    return GCAConfig.from_dict(payload["model"]), payload.get("export", {})


def load_pretrained(
    directory: str | os.PathLike, *, device: str | torch.device = "cpu", **overrides
) -> torch.nn.Module:
    """Build the model (``GCAForCausalLM``, or the baseline for ``arch=swa``) from ``config.json`` (``overrides``
    replace config fields, e.g. ``attn_backend``) and load ``model.safetensors`` strictly: a missing, unexpected
    or mis-shaped tensor is an error naming it."""
    from safetensors.torch import load_model

    cfg, _ = read_export_config(directory)
    if overrides:
        cfg = GCAConfig.from_dict({**cfg.to_dict(), **overrides})
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing model weights")
    model = build_model(cfg)
    missing, unexpected = load_model(model, str(weights), strict=False, device=str(device))
    if missing or unexpected:
        raise ValueError(f"{weights}: missing tensors {sorted(missing)}, unexpected tensors {sorted(unexpected)}")
    return model.to(device).eval()

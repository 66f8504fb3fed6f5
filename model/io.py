"""Model export for downstream jobs: ``model.safetensors`` + ``config.json``; nothing is ever unpickled.

Loading checks both files before any tensor is read, so a damaged or foreign export fails with one line naming the
file and what is wrong (``ExportError``) instead of a library traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from data_prep.json_file import Fields, JsonFileError, read_json
from data_prep.safe_write import replacing, write_text
from model.archs import build_model
from model.config import GCAConfig
from model.lm import CausalLM

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

_HEADER_LEN_BYTES = 8
"""A safetensors file starts with the byte length of its JSON header (unsigned 64-bit, little-endian)."""
_MAX_HEADER_BYTES = 100 << 20
"""The safetensors library refuses larger headers too; a bigger length means the file is something else."""
_FOREIGN_MAGIC = {b"PK\x03\x04": "a zip archive (torch.save)", b"\x80": "a pickle"}


class ExportError(ValueError):
    """An export file that cannot be loaded; the message names the file, what is wrong and the fix."""


def save_pretrained(model: CausalLM, directory: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write the model's config and fp32 weights to ``directory`` (created; files replaced atomically).

    ``extra`` (e.g. training length, tokenizer path) is stored under ``"export"`` in ``config.json``.
    """
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with replacing(directory / WEIGHTS_NAME) as weights:
        save_model(model, str(weights), metadata={"format": "pt"})
    payload = {"model": model.cfg.to_dict(), "export": extra or {}}
    write_text(directory / CONFIG_NAME, json.dumps(payload, indent=2, sort_keys=True))
    return directory


def read_export_config(directory: str | os.PathLike) -> tuple[GCAConfig, dict]:
    """Return the model config and the ``export`` metadata of an export directory.

    Raises:
        FileNotFoundError: no ``config.json`` file.
        ExportError: ``config.json`` is not UTF-8 JSON, not an object with a ``model`` object (and optionally an
            ``export`` object), or its model config breaks a rule.
    """
    path = Path(directory) / CONFIG_NAME
    try:  # bounded size and nesting, regular file only: an export may come from someone else
        fields = Fields(read_json(path), str(path))
        model, export = fields.mapping("model"), fields.mapping("export", default={})
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME} file; is {directory} a model export directory?") from None
    except JsonFileError as exc:
        raise ExportError(f"{exc} (an export's {CONFIG_NAME} is written by save_pretrained)") from None
    try:
        return GCAConfig.from_dict(model), export
    except (ValueError, TypeError) as exc:  # ConfigError names the key
        raise ExportError(f"{path}: {exc}") from None


def _describe_foreign(head: bytes) -> str:
    """What a non-safetensors file looks like, for the error message."""
    for magic, kind in _FOREIGN_MAGIC.items():
        if head.startswith(magic):
            return f"; it looks like {kind}, which is never loaded (re-export with model.save_pretrained)"
    return ""


def _read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the size of its data area, checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER_LEN_BYTES)
        length = int.from_bytes(head, "little") if len(head) == _HEADER_LEN_BYTES else -1
        if not 2 <= length <= min(size - _HEADER_LEN_BYTES, _MAX_HEADER_BYTES):
            raise ExportError(
                f"{path}: not a safetensors file ({size} bytes; the header length field does not fit "
                f"the file){_describe_foreign(head)}"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, size - _HEADER_LEN_BYTES - length


def check_safetensors(path: str | os.PathLike) -> dict[str, list[int]]:
    """Validate a safetensors file's structure without reading any tensor; return ``name -> shape``.

    Raises:
        ExportError: the file is not safetensors (garbage, a pickle or torch zip renamed), or it is truncated or
            has bytes its header does not describe.
    """
    path = Path(path)
    header, data_bytes = _read_header(path)
    shapes, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
            or not isinstance(shape, list)
        ):
            raise ExportError(f"{path}: not a valid safetensors file (bad header entry for tensor {name!r})")
        shapes[name], end = shape, max(end, offsets[1])
    if end > data_bytes:
        raise ExportError(
            f"{path}: truncated: its tensors need {end} data bytes but the file holds {data_bytes} "
            "(copy the export again)"
        )
    if end < data_bytes:
        raise ExportError(
            f"{path}: {data_bytes - end} bytes after the last tensor; the file is damaged or not "
            "written by save_pretrained"
        )
    return shapes


def _check_shapes(weights: Path, file_shapes: dict[str, list[int]], model: torch.nn.Module) -> None:
    """Refuse tensors whose shape in the file differs from the model that ``config.json`` describes."""
    wanted = {name: list(t.shape) for name, t in model.state_dict().items()}
    wrong = [n for n, shape in file_shapes.items() if n in wanted and shape != wanted[n]]
    if wrong:
        name = wrong[0]
        raise ExportError(
            f"{weights}: tensor {name} has shape {file_shapes[name]} but {CONFIG_NAME} describes a "
            f"model needing {wanted[name]} ({len(wrong)} tensor(s) differ); the two files come from "
            "different exports"
        )


def check_finite_weights(weights: str | os.PathLike, model: torch.nn.Module) -> None:
    """Refuse NaN or infinite weights just loaded from ``weights`` (a diverged run's export): they would give NaN
    scores, a sampling error or a NaN first training step far from their cause. One pass over tensors just read, so
    cheap next to the load itself.

    Raises:
        ExportError: naming the file, the first non-finite tensor and how many of its values are bad.
    """
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ExportError(
                f"{weights}: tensor {name} holds {bad} non-finite value(s) (NaN or inf); the export is damaged "
                "or comes from a diverged run (export an earlier checkpoint)"
            )


def load_pretrained(directory: str | os.PathLike, *, device: str | torch.device = "cpu", **overrides) -> CausalLM:
    """Build the model ``config.json`` describes (``build_model`` picks the class its ``arch`` names; ``overrides``
    replace config fields, e.g. ``gca_backend``) and load ``model.safetensors`` strictly: a missing, unexpected,
    mis-shaped or non-finite tensor is an error naming it.

    Raises:
        FileNotFoundError: ``config.json`` or ``model.safetensors`` is missing.
        ExportError: either file is malformed (see ``read_export_config`` and ``check_safetensors``), or a weight
            is NaN or infinite.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    cfg, _ = read_export_config(directory)
    if overrides:
        cfg = GCAConfig.from_dict({**cfg.to_dict(), **overrides})
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing model weights")
    file_shapes = check_safetensors(weights)
    model = build_model(cfg)
    _check_shapes(weights, file_shapes, model)
    try:
        missing, unexpected = load_model(model, str(weights), strict=False, device=str(device))
    except (SafetensorError, RuntimeError) as exc:  # what the structural checks above cannot see, e.g. a dtype
        raise ExportError(f"{weights}: cannot be loaded ({str(exc).splitlines()[0]})") from None
    if missing or unexpected:
        raise ExportError(f"{weights}: missing tensors {sorted(missing)}, unexpected tensors {sorted(unexpected)}")
    check_finite_weights(weights, model)
    return model.to(device).eval()

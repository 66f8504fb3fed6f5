"""Turn a saved training checkpoint (``<run_dir>/checkpoints/step_N``) into an export that both this repository
(``model.load_pretrained``) and Hugging Face tools (``pipeline.hf.write_hf_files``) load.

A checkpoint is verified as the trainer verifies it before a resume (commit marker, sha256 manifest, no pickle
that could run code). Its weights come from the eval export inside it when the run wrote one
(``checkpoint.export``, the default); otherwise from the engine state: ``state.pt`` (single process and DDP),
``dcp/`` (FSDP, read without a process group) or ``deepspeed/`` (consolidated to fp32 by DeepSpeed's own tool).
The tokenizer then comes from the dataset named in the checkpoint's config, and must be the one the run was
trained on (the data fingerprint's ``tokenizer_sha256``).

``write_export`` writes every fresh export, this one's and the trainer's eval export alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from data_prep.dataset_tokenizer import TokenizerFiles
from data_prep.format import HF_TOKENIZER_CONFIG, HF_TOKENIZER_JSON
from data_prep.safe_files import open_regular, stat_regular
from data_prep.safe_write import replacing, write_bytes
from model import CausalLM, GCAConfig, build_model, read_export_config, save_pretrained
from model.io import CONFIG_NAME, WEIGHTS_NAME, ExportError, check_safetensors
from pipeline.data.reader import read_tokenizer
from pipeline.hf.export import write_hf_files
from pipeline.train.checkpoint import COMMIT_MARKER, TRAINER_STATE, CheckpointError, scan_pickles, verify_integrity
from pipeline.train.dist import DistInfo

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
"""The eval export a checkpoint holds when the run set ``checkpoint.export`` (written by the trainer)."""
_ONE_PROCESS = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."
"""What activation checkpointing inserts into parameter names of a ``state.pt`` model state."""


def _check_out(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"--out {target} exists and is not an empty directory; choose a new one")


@contextlib.contextmanager
def _removed_on_failure(target: Path) -> Iterator[None]:
    """A failed export leaves no half-written directory behind."""
    try:
        yield
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


def export_directory(export: str | Path, out: str | Path) -> Path:
    """Copy the export directory ``export`` (``model.save_pretrained``'s) to the new directory ``out`` and add the
    Hugging Face files (an export written before they existed, say)."""
    source, target = Path(export), Path(out)
    _check_out(target)
    read_export_config(source)
    with _removed_on_failure(target):
        _copy_export(source, target)
        return write_hf_files(target)


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the export of the committed training checkpoint ``checkpoint`` into the new directory ``out``.

    Raises:
        FileExistsError: ``out`` exists and is not empty.
        CheckpointError: not a committed checkpoint, its trainer state is unreadable, or it holds no weights.
        pipeline.train.checkpoint.CheckpointCorruptError / UnsafeCheckpointError: it fails verification.
    """
    source, target = Path(checkpoint), Path(out)
    _check_out(target)
    if not (source / COMMIT_MARKER).is_file():
        raise CheckpointError(
            f"{source} is not a committed training checkpoint (no {COMMIT_MARKER} marker); pass "
            "<run_dir>/checkpoints/step_N"
        )
    verify_integrity(source, _ONE_PROCESS)
    state = _trainer_state(source)
    with _removed_on_failure(target):
        if (source / EXPORT_DIR / WEIGHTS_NAME).is_file():
            _copy_export(source / EXPORT_DIR, target)
            write_hf_files(target)
        else:
            scan_pickles(source)
            _export_engine_state(source, state, target)
    log.info("exported %s (step %s) to %s", source, state.get("step"), target)
    return target


def _copy_export(source: Path, target: Path) -> None:
    """Copy an export's own files -- ``config.json``, the weights and the tokenizer it names by a plain file name --
    each only as a regular file reached without a link (a FIFO or a link to elsewhere is refused, never read);
    the copied weights must be a safetensors file."""
    _, export = read_export_config(source)
    names = [CONFIG_NAME, WEIGHTS_NAME]
    tokenizer = export.get("tokenizer")
    if isinstance(tokenizer, str) and tokenizer:
        if "/" in tokenizer or tokenizer in (".", ".."):
            raise ExportError(
                f"{source / CONFIG_NAME}: export.tokenizer={tokenizer!r} must be a file name in the export"
            )
        names.append(tokenizer)
        if tokenizer == HF_TOKENIZER_JSON and stat_regular(source, HF_TOKENIZER_CONFIG) is not None:
            names.append(HF_TOKENIZER_CONFIG)  # its special tokens
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        with os.fdopen(open_regular(source, name), "rb") as src, replacing(target / name) as copy:
            with open(copy, "wb") as dst:
                shutil.copyfileobj(src, dst)
    check_safetensors(target / WEIGHTS_NAME)


def _trainer_state(source: Path) -> dict[str, Any]:
    try:
        state = json.loads((source / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{source / TRAINER_STATE}: unreadable trainer state ({err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model_config"), dict):
        raise CheckpointError(f"{source / TRAINER_STATE}: no model_config; not written by this trainer")
    return state


def write_export(
    model: CausalLM, directory: Path, *, step: int | None, seq_len: int | None, tokenizer: TokenizerFiles | None
) -> Path:
    """Write the export of ``model`` into ``directory``: safetensors weights and ``config.json`` (``step`` and the
    training ``seq_len`` under ``export``), the dataset's ``tokenizer`` files (``tokenizer.model``, or
    ``tokenizer.json`` + ``tokenizer_config.json``; the config names the first; None: no tokenizer, the export then
    reads text as bytes) and the Hugging Face files (``write_hf_files``).

    The one writer of a fresh export: the trainer's eval export and the export of a checkpoint's engine state."""
    extra: dict[str, Any] = {"step": step, "seq_len": seq_len}
    if tokenizer is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in tokenizer.files().items():
            write_bytes(directory / name, data)
        extra["tokenizer"] = tokenizer.name
    save_pretrained(model, directory, extra=extra)
    return write_hf_files(directory)


def _export_engine_state(source: Path, state: dict[str, Any], target: Path) -> None:
    """Rebuild the model from the checkpoint's own config and engine weights, and export it with its tokenizer."""
    model = build_model(GCAConfig.from_dict(state["model_config"]))
    model.load_state_dict(_engine_weights(source, model))
    config = yaml.safe_load(state.get("config_yaml") or "{}") or {}
    seq_len = config.get("train", {}).get("seq_len")
    write_export(model, target, step=state.get("step"), seq_len=seq_len, tokenizer=_training_tokenizer(config, state))


def _engine_weights(source: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if (source / "state.pt").is_file():
        saved = torch.load(source / "state.pt", map_location="cpu", weights_only=True)["model"]
        return {name.replace(_CHECKPOINT_WRAPPER, ""): tensor for name, tensor in saved.items()}
    if (source / "dcp").is_dir():
        import torch.distributed.checkpoint as dcp

        wanted = {"model": model.state_dict()}
        dcp.load(wanted, checkpoint_id=str(source / "dcp"), no_dist=True)
        return wanted["model"]
    if (source / "deepspeed").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(source / "deepspeed"), tag="state")
    raise CheckpointError(f"{source} holds neither an {EXPORT_DIR}/ nor engine state (state.pt, dcp/, deepspeed/)")


def _training_tokenizer(config: dict[str, Any], state: dict[str, Any]) -> TokenizerFiles | None:
    """The tokenizer next to the run's ``data.path``, if it is still there and is the one trained on."""
    data_path = config.get("data", {}).get("path")
    tokenizer = read_tokenizer(data_path) if isinstance(data_path, str) else None
    expected = (state.get("data_fingerprint") or {}).get("tokenizer_sha256")
    if tokenizer is None:
        log.warning("no tokenizer next to data.path=%s: the export gets no tokenizer files", data_path)
        return None
    if expected is not None and tokenizer.sha256 != expected:
        raise CheckpointError(
            f"the tokenizer next to data.path={data_path} is not the one this checkpoint was trained with "
            f"(sha256 {tokenizer.sha256} vs {expected})"
        )
    return tokenizer

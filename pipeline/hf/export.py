"""Make an export folder (``model.io.save_pretrained``'s ``config.json`` + ``model.safetensors``) a ``transformers``
model folder too: ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(dir)`` then load it with only torch, transformers and sentencepiece installed.

``config.json`` keeps its ``model`` and ``export`` objects (``model.io.load_pretrained`` reads the same folder) and
gains the keys ``transformers`` reads; the remote code is the repository's own model code (``pipeline.hf.bundle``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from data_prep.dataset_tokenizer import HF, TokenizerFiles, named_tokenizer_files
from data_prep.safe_files import UnsafeDatasetError
from data_prep.safe_write import write_text
from model.io import CONFIG_NAME, read_export_config
from pipeline.hf.bundle import MANIFEST_NAME, manifest, shipped_files
from pipeline.hf.tokenizer import (
    TOKENIZER_MODEL,
    UnsupportedTokenizerError,
    special_token_ids,
    write_hf_tokenizer_config,
    write_tokenizer_files,
)

log = logging.getLogger(__name__)

MODEL_TYPE = "gca"
"""``GCAHFConfig.model_type`` (a test checks they agree): importing the class would load transformers into every
training process that writes an export."""
HF_CLASS_NAMES = {
    "AutoConfig": "configuration_gca.GCAHFConfig",
    "AutoModelForCausalLM": "modeling_gca.GCAHFForCausalLM",
}


def _tokenizer_files(directory: Path, export: dict) -> TokenizerFiles | None:
    """The tokenizer the export names (``export.tokenizer``) if it is there, else None."""
    name = export.get("tokenizer")
    if not name:
        return None
    if not isinstance(name, str) or "/" in name or name in (".", ".."):
        log.warning("%s: export.tokenizer=%r is not a file name in the export: no tokenizer files", directory, name)
        return None
    try:
        return named_tokenizer_files(directory, name)
    except FileNotFoundError:
        log.warning("%s names tokenizer %s, which is missing: no Hugging Face tokenizer files", directory, name)
    except UnsafeDatasetError as err:
        # The message, not the exception: a kept log record (pytest's, a buffering handler) would hold its traceback
        # and through it the caller's frames, the trainer among them.
        log.warning("%s: tokenizer %s not read (%s): no Hugging Face tokenizer files", directory, name, str(err))
    return None


def write_hf_files(directory: str | os.PathLike) -> Path:
    """Add the ``transformers`` files to the export in ``directory``: the ``config.json`` keys (``model_type``,
    ``auto_map``, ``architectures``, special token ids), the remote code with its source manifest, and the tokenizer
    files: converted from a SentencePiece tokenizer, or for a Hugging Face ``tokenizer.json`` that file as it is
    with a matching ``tokenizer_config.json`` (``pipeline.hf.tokenizer``).

    A tokenizer that is missing, or a SentencePiece model that normalises text (not one data prep trains, so its
    encoding cannot be reproduced exactly), or a ``tokenizer.json`` that does not parse, gets no tokenizer files and
    a warning; the model files are written all the same.

    Raises:
        FileNotFoundError: no ``config.json``.
        model.io.ExportError: ``config.json`` is not a valid export config.
    """
    root = Path(directory)
    read_export_config(root)  # refuse anything that is not an export before writing into it
    payload = json.loads((root / CONFIG_NAME).read_text(encoding="utf-8"))
    export = payload.get("export", {})
    tokenizer = _tokenizer_files(root, export)
    files = shipped_files()
    for shipped in files:
        write_text(root / shipped.name, shipped.text)
    write_text(root / MANIFEST_NAME, json.dumps(manifest(files), indent=2, sort_keys=True))
    special_ids: dict[str, int] = {}
    try:
        if tokenizer is not None and tokenizer.kind == HF:
            special_ids = write_hf_tokenizer_config(root, tokenizer)
        elif tokenizer is not None:
            write_tokenizer_files(root, tokenizer.data)
            special_ids = special_token_ids(tokenizer.data)
            export["tokenizer"] = TOKENIZER_MODEL  # AutoTokenizer and the native loader read the same file
    except (UnsupportedTokenizerError, ValueError) as err:
        log.warning("%s: no Hugging Face tokenizer files (%s); the model itself loads", root, str(err))
    payload.update(
        {
            "export": export,
            "model_type": MODEL_TYPE,
            "architectures": [HF_CLASS_NAMES["AutoModelForCausalLM"].split(".")[1]],
            "auto_map": HF_CLASS_NAMES,
            "torch_dtype": "float32",
            "tie_word_embeddings": False,
            "use_cache": True,
            **special_ids,
        }
    )
    write_text(root / CONFIG_NAME, json.dumps(payload, indent=2, sort_keys=True))
    return root

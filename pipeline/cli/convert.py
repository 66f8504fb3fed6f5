"""Convert a dense checkpoint into a GCA export: ``python -m pipeline.cli.convert --dense <transformers dir> --out
<dir> [model.<key>=<value> ...]``.

The dense model's shapes come from its ``config.json`` (``model.convert.dense_overrides``); the overrides choose the
layout (``model.n_lower_layers``, ``model.groups``, ``model.n_encoder_layers``, ``model.chunk_size``,
``model.top_k``, ``model.window``, ...; the defaults otherwise, with ``model.tokens_see_landmarks=false`` so the
export computes the dense logits inside the window). The export is a normal one (``model.load_pretrained``, the eval
jobs, ``checkpoint.init_from=<dir>``, ``transformers``' Auto classes) and carries the dense folder's tokenizer: its
SentencePiece ``tokenizer.model`` when it has one, else its ``tokenizer.json`` (``data_prep.dataset_tokenizer``).
Exit status: 0 done, 2 a bad argument or checkpoint (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from data_prep.dataset_tokenizer import folder_tokenizer
from data_prep.entry import run
from data_prep.safe_files import UnsafeDatasetError
from data_prep.safe_write import UnsafeWriteError
from model.config import ConfigError, GCAConfig
from model.convert import DENSE_KEYS, ConversionError, convert_dense
from pipeline.train.export import write_export


def parse_layout(overrides: list[str]) -> GCAConfig:
    """``model.<key>=<value>`` strings (YAML values) on top of ``tokens_see_landmarks=false``."""
    values: dict[str, object] = {"tokens_see_landmarks": False}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.startswith("model."):
            raise ConfigError(f"{item!r}: expected model.<key>=<value>")
        name = key.removeprefix("model.")
        if name in DENSE_KEYS:
            raise ConfigError(f"{key} comes from the dense checkpoint's config.json; give only layout keys")
        values[name] = yaml.safe_load(raw)
    return GCAConfig.from_dict({**GCAConfig().to_dict(), **values})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", type=Path, required=True, help="a transformers folder (config.json + safetensors)")
    p.add_argument("--out", type=Path, required=True, help="new directory for the GCA export")
    p.add_argument("overrides", nargs="*", help="model.<key>=<value> layout keys")
    args = p.parse_args(argv)
    try:
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            raise FileExistsError(f"--out {args.out} exists and is not an empty directory; choose a new one")
        model, source = convert_dense(args.dense, parse_layout(args.overrides))
        tokenizer = folder_tokenizer(args.dense)
        out = write_export(model, args.out, step=None, seq_len=None, tokenizer=tokenizer)
    except (ConfigError, ConversionError, FileExistsError, TypeError, UnsafeDatasetError, UnsafeWriteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    new = sum(origin.startswith("new") for origin in source.values())
    print(f"{out} ({len(source)} GCA tensors, {new} new)")
    return 0


if __name__ == "__main__":
    run(main)

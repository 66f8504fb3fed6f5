"""Export a training checkpoint: ``python -m pipeline.cli.export --checkpoint <run>/checkpoints/step_N --out <dir>``.

The result loads with ``model.load_pretrained`` and, offline and without this repository, with
``AutoModelForCausalLM.from_pretrained(<dir>, trust_remote_code=True)`` and ``AutoTokenizer.from_pretrained(<dir>)``.
``--checkpoint`` may also be an export directory (e.g. ``<run_dir>/export`` from an older release), which is copied
and given the Hugging Face files. Exit status: 0 done, 2 a bad argument or checkpoint (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.entry import run
from data_prep.redaction import redact
from model.io import CONFIG_NAME, ExportError
from pipeline.train.checkpoint import COMMIT_MARKER, CheckpointError
from pipeline.train.export import export_checkpoint, export_directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="<run_dir>/checkpoints/step_N, or an export dir")
    p.add_argument("--out", type=Path, required=True, help="new directory for the export")
    args = p.parse_args(argv)
    try:
        is_export = (args.checkpoint / CONFIG_NAME).is_file() and not (args.checkpoint / COMMIT_MARKER).is_file()
        out = (export_directory if is_export else export_checkpoint)(args.checkpoint, args.out)
    except (CheckpointError, ExportError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    run(main)

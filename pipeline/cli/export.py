"""Export a training checkpoint: ``python -m pipeline.cli.export --checkpoint <run>/checkpoints/step_N --out <dir>``.

The result loads with ``model.load_pretrained`` and, offline and without this repository, with
``AutoModelForCausalLM.from_pretrained(<dir>, trust_remote_code=True)`` and ``AutoTokenizer.from_pretrained(<dir>)``.
``--checkpoint`` may also be an export directory written before exports held the Hugging Face files (an older
release's ``<run_dir>/export``), which is copied and given them; an export that holds them is refused, as it loads
as it is and a copy would only hide that a training checkpoint was meant. Exit status: 0 done, 2 a bad argument or
checkpoint (nothing is written).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from data_prep.entry import run
from data_prep.redaction import redact
from model.io import CONFIG_NAME, ExportError
from pipeline.hf.bundle import MANIFEST_NAME
from pipeline.train.checkpoint import COMMIT_MARKER, CheckpointError
from pipeline.train.export import export_checkpoint, export_directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="<run_dir>/checkpoints/step_N, or an export dir")
    p.add_argument("--out", type=Path, required=True, help="new directory for the export")
    args = p.parse_args(argv)
    try:
        is_export = (args.checkpoint / CONFIG_NAME).is_file() and not (args.checkpoint / COMMIT_MARKER).is_file()
        if is_export and os.path.lexists(args.checkpoint / MANIFEST_NAME):
            raise CheckpointError(_already_an_export(args.checkpoint))
        out = (export_directory if is_export else export_checkpoint)(args.checkpoint, args.out)
    except (CheckpointError, ExportError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _already_an_export(export: Path) -> str:
    """Why ``export`` (an export with its Hugging Face files) is not exported again, and what to pass instead: the
    checkpoint holding it, the newest committed checkpoint of the run beside it, or the pattern of one."""
    committed = sorted(p.parent for p in export.parent.glob(f"checkpoints/step_*/{COMMIT_MARKER}"))
    if (export.parent / COMMIT_MARKER).is_file():
        instead = f"its checkpoint, --checkpoint {export.parent}"
    elif committed:
        instead = f"a checkpoint of that run, e.g. --checkpoint {committed[-1]}"
    else:
        instead = "a training checkpoint, --checkpoint <run_dir>/checkpoints/step_N"
    return (
        f"--checkpoint {export} is already an export (config.json, weights and the Hugging Face files): it loads as "
        f"it is (launch/eval.py --checkpoint {export}, or AutoModelForCausalLM.from_pretrained with "
        f"trust_remote_code=True); to export a training step, pass {instead}"
    )


if __name__ == "__main__":
    run(main)

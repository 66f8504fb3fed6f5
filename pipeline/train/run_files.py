"""The files the trainer keeps at the top of ``run_dir``, and the check that none of them was planted as a link.

``run_dir`` may be on a shared file system where someone else can create names in it before the run does. Every
write goes through ``data_prep.safe_write`` and is refused there; this check makes the refusal come before any
work (model build, data, the first step) instead of when the file is first written, which for the eval export is
after the last step. The eval export folder is the trainer's own, so everything in it is checked, not only the
names this version writes.
"""

from __future__ import annotations

from pathlib import Path

from data_prep.safe_write import UnsafeWriteError, check_names
from pipeline.train.config import ConfigError
from pipeline.train.export import EXPORT_DIR

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"


def check_run_files(run_dir: Path) -> None:
    """Refuse a ``run_dir`` where a file the trainer writes is a symbolic or hard link, a FIFO or a folder.

    Raises:
        ConfigError: naming the path and what it is.
    """
    export = run_dir / EXPORT_DIR
    try:
        check_names(run_dir, [CONFIG_FILE, METRICS_FILE, WANDB_ID_FILE])
        if export.is_dir() and not export.is_symlink():
            check_names(export, sorted(p.name for p in export.iterdir()))
    except UnsafeWriteError as err:
        raise ConfigError(f"run_dir={run_dir}: {err}") from None

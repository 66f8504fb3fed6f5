"""An offline wandb run written by the trainer is what `wandb sync` uploads later: wandb's own CLI, in its
no-network dry run, finds exactly one run in it (and none in a folder that is not a run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.train.trainer import main

WANDB = Path(sys.executable).parent / "wandb"


def _dry_run_sync(path: Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    done = subprocess.run(
        [str(WANDB), "sync", "--dry-run", str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_the_offline_run_folder_is_what_wandb_sync_uploads(tmp_path, tiny_data, overrides, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(None, overrides(run, tiny_data, **{"train.max_steps": 3, "logging.wandb": True})) == 0
    (offline_run,) = (run / "wandb").glob("offline-run-*")
    (records,) = offline_run.glob("run-*.wandb")
    listed = _dry_run_sync(offline_run, tmp_path)
    assert "Would sync 1 run(s)" in listed and records.name in listed, listed
    assert "No runs to sync" in _dry_run_sync(run / "checkpoints", tmp_path)

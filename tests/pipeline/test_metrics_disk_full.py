"""A disk that fills while the trainer writes ``metrics.jsonl`` (issue 64, finding 5): one line naming the file, the
full disk and the last committed checkpoint, exit 1, as a checkpoint save that meets a full disk says it; no
traceback (the old code showed two chained ENOSPC tracebacks naming neither the file nor the run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The training command with the file system under metrics.jsonl filling up: the file is opened as the trainer opens
# it, then every write to its descriptor from the FULL_AT-th on fails with ENOSPC, as a write into a full disk does.
# (A real small file system needs root; the write fails where the real one would, below Python's buffering.)
_RUN_WITH_A_DISK_THAT_FILLS = """
import errno, io, os, runpy, sys
import pipeline.train.metrics as metrics

FULL_AT = int(os.environ["FULL_AT"])
real_open_append = metrics.open_append

class FillingDisk(io.FileIO):
    writes = 0

    def write(self, data):
        FillingDisk.writes += 1
        if FillingDisk.writes >= FULL_AT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)

def open_append(path, binary=False):
    with real_open_append(path, binary=True) as opened:
        fd = os.dup(opened.fileno())
    return io.TextIOWrapper(io.BufferedWriter(FillingDisk(fd, "a")), encoding="utf-8")

metrics.open_append = open_append
sys.argv = ["launch/pretrain.py", *sys.argv[1:]]
runpy.run_path("launch/pretrain.py", run_name="__main__")
"""


def _the_one_error_line(script: str, args: list[str], **env_vars: str) -> str:
    """Train with ``script`` standing in front of launch/pretrain.py; it must end with exit 1 and one error line,
    no traceback, which is returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    env.pop("PIPE_FAULT", None)
    command = [sys.executable, "-c", script, "--config", "configs/train/debug.yaml", *args]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]


def test_a_disk_that_fills_while_metrics_are_written_is_one_line_naming_the_file_and_the_checkpoint(
    tmp_path, tiny_data, overrides
):
    run = tmp_path / "run"
    settings = {"train.max_steps": 8, "train.eval_every": 0, "checkpoint.every": 2, "checkpoint.export": False}
    # Writes: the start record, then one line per step; the 6th is step 5's, after the checkpoint of step 4.
    line = _the_one_error_line(_RUN_WITH_A_DISK_THAT_FILLS, overrides(run, tiny_data, **settings), FULL_AT="6")
    assert f"No space left on device (errno 28) writing {run / 'metrics.jsonl'}; free space on that file system" in line
    assert f"the last committed checkpoint is {run / 'checkpoints' / 'step_00000004'}" in line, line
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5  # start + steps 1-4, each line whole


# The training command with the disk already full when the run's config.yaml is written at the start.
_RUN_WITH_A_FULL_DISK_AT_THE_START = """
import errno, os, runpy, sys
import pipeline.train.callbacks.metrics as callbacks

def write_text(path, text, **options):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

callbacks.write_text = write_text
sys.argv = ["launch/pretrain.py", *sys.argv[1:]]
runpy.run_path("launch/pretrain.py", run_name="__main__")
"""


def test_a_full_disk_when_config_yaml_is_written_is_the_same_one_line(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    settings = {"train.max_steps": 4, "train.eval_every": 0, "checkpoint.export": False}
    line = _the_one_error_line(_RUN_WITH_A_FULL_DISK_AT_THE_START, overrides(run, tiny_data, **settings))
    assert f"No space left on device (errno 28) writing {run / 'config.yaml'}" in line, line
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())

"""Resumable multi-stage jobs (``make demo``, ``make demo-lm``): each stage is a subprocess running the command a
user could type, printed before it runs, timed, and skipped when the file it produces already exists, so an
interrupted job continues where it stopped."""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from data_prep.safe_write import write_text

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """A stage failed or did not produce its output; the message names the stage and the command."""


class StageRunner:
    """Runs stages from ``cwd`` and keeps their wall times in ``<run_dir>/timings.json``."""

    def __init__(self, run_dir: Path, cwd: Path) -> None:
        self.run_dir, self.cwd = run_dir, cwd
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.timings_path = self.run_dir / "timings.json"
        self.timings: dict[str, float] = (
            json.loads(self.timings_path.read_text()) if self.timings_path.is_file() else {}
        )

    def run(self, name: str, cmd: list[str], done: Path, env: dict[str, str] | None = None) -> None:
        """Run ``cmd`` unless ``done`` exists; afterwards ``done`` must exist.

        Raises:
            StageError: the command failed or did not write ``done``.
        """
        if done.exists():
            log.info("[%s] already done (%s exists); skipping", name, _shown(done, self.cwd))
            return
        log.info("[%s] $ %s", name, shlex.join(cmd))
        t0 = time.perf_counter()
        result = subprocess.run(cmd, cwd=self.cwd, env={**os.environ, **(env or {})})
        if result.returncode != 0:
            raise StageError(f"stage '{name}' failed with exit code {result.returncode}: {shlex.join(cmd)}")
        if not done.exists():
            raise StageError(f"stage '{name}' finished but did not produce {done}")
        self.record(name, time.perf_counter() - t0)

    def record(self, name: str, seconds: float) -> None:
        """Store a stage's wall time (also for work done in-process)."""
        self.timings[name] = round(seconds, 1)
        write_text(self.timings_path, json.dumps(self.timings, indent=2))
        log.info("[%s] done in %.0f s", name, self.timings[name])


def _shown(path: Path, cwd: Path) -> str:
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)


TRAIN_MODULE = "pipeline.cli.train"
EVAL_MODULE = "pipeline.cli.eval"


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def train_command(ranks: int, config: str, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The DeepSpeed launch of the trainer on ``ranks`` CPU ranks of this machine, and its environment. The
    rendezvous port is a free one, not DeepSpeed's fixed 29500, so a demo runs next to another training job."""
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    launcher = [deepspeed, "--num_gpus", str(ranks), "--master_port", str(free_port())]
    cmd = [*launcher, "--module", TRAIN_MODULE, "--config", config, *overrides]
    return cmd, {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def eval_command(export: Path, task: str, out: Path, keys: list[str]) -> tuple[list[str], dict[str, str]]:
    """``python -m pipeline.cli.eval`` of ``task`` on ``export`` into ``out``, and its environment."""
    cmd = [sys.executable, "-m", EVAL_MODULE, "--checkpoint", str(export), "--task", task, "--out", str(out), *keys]
    return cmd, {"OMP_NUM_THREADS": "2"}

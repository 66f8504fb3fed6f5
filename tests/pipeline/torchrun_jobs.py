"""torchrun jobs of the pipeline tests, torn down whole even when a test fails.

torchrun starts each rank in a session of its own, so killing torchrun's process group (what
``helpers.run_process_group`` does on a timeout) leaves the ranks running, and holding the output pipes the test
then waits on. `kill_job` also kills each rank's own process group, found before torchrun dies (its ranks are then
orphans of pid 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def torchrun_cmd(nproc: int, args: list[str]) -> list[str]:
    """``torchrun --standalone`` (it binds a free port itself) of ``launch/pretrain.py`` with ``nproc`` ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [*launcher, "--max-restarts", "0", "launch/pretrain.py", "--config", "configs/train/debug.yaml", *args]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the rank of torchrun ``launcher`` whose environment says ``RANK=rank``."""
    for pid in children(launcher):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's process group and each rank's (which kills a stopped rank too), while torchrun runs: the
    pid of a job already reaped may belong to another process by now."""
    if proc.poll() is not None:
        return
    for pgid in [*children(proc.pid), proc.pid]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def start_job(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish_job(proc: subprocess.Popen, timeout: float) -> str:
    """Everything ``proc`` printed once it ended; past ``timeout`` seconds the whole job is killed (a failure)."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out = proc.communicate()[0]
        pytest.fail(f"still running after {timeout:.0f} s (killed):\n{out[-4000:]}")
    finally:
        if proc.poll() is None:  # interrupted in the wait
            kill_job(proc)
            proc.communicate()


def run_job(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` to its end under a hard ``timeout``; its exit code, output and wall time."""
    started = time.monotonic()
    proc = start_job(cmd, env)
    out = finish_job(proc, timeout)
    return proc.returncode, out, time.monotonic() - started

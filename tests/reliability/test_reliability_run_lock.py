"""One training per ``run_dir`` (docs/reliability.md C6): a second training into a busy ``run_dir`` is refused at the
start, naming the holder, before it writes anything; a lock left by a killed run, or by an earlier incarnation of
the same SLURM job, does not block.

The holder is always an independent process: a real trainer paused inside a step by the fault injector, or a
plain ``flock`` taken by a separate Python process (what any other program holding the file would do).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from reliability_harness import CONFIG, REPO, overrides, train_process, train_ranks

from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability

LOCK_FILE = "run.lock"


def listing(run: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``run`` with its size and mtime (ns): what a refused run must leave as it was."""
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def test_a_second_training_into_a_busy_run_dir_is_refused_and_a_killed_holder_does_not_block(data, tmp_path, caplog):
    """Before: the second run trained into the same run_dir (both wrote metrics.jsonl; one died at its first save).
    Now: it exits 2 with one line naming the holder's host and pid and leaves every file as it was; after the
    holder is SIGKILLed, the same command resumes and finishes."""
    run = tmp_path / "run"
    command = overrides(run, data, **{"train.max_steps": 6, "checkpoint.every": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PIPE_FAULT": "hang:step=4:secs=120"}
    holder = subprocess.Popen(
        [sys.executable, str(REPO / "launch/pretrain.py"), "--config", CONFIG, *command],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: logged_steps(run) == [1, 2, 3], 90, "the holder to reach step 4 (where it hangs)")
        before = listing(run)
        second = train_process(command, timeout=60)
        assert second.returncode == 2, second.output[-3000:]
        errors = [line for line in second.output.splitlines() if "[ERROR]" in line]
        assert len(errors) == 1, second.output[-3000:]
        assert f"host {socket.gethostname()}" in errors[0] and f"pid {holder.pid}" in errors[0], errors[0]
        assert str(run) in errors[0] and "Traceback" not in second.output
        assert listing(run) == before
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / LOCK_FILE).is_file()  # the dead holder's lock file and record stay; the OS lock went with it
    caplog.set_level(logging.INFO)
    assert main(CONFIG, command) == 0
    assert logged_steps(run)[-3:] == [4, 5, 6]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "run.lock" in r.getMessage()]


HOLD = textwrap.dedent(
    """
    import fcntl, json, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps(json.loads(sys.argv[2]) | {"pid": os.getpid()}).encode())
    print("held", flush=True)
    time.sleep(120)
    """
)


def hold_lock(run: Path, record: dict[str, object]) -> subprocess.Popen[str]:
    """A separate process that holds the OS lock on ``run/run.lock`` with ``record`` as the holder's record."""
    run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run / LOCK_FILE), json.dumps(record)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("restart", ["1", "0"])
def test_an_earlier_incarnation_of_the_same_slurm_job_does_not_block_a_requeued_run(
    data, tmp_path, monkeypatch, caplog, restart
):
    """A requeued SLURM job (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT) may find its own earlier incarnation's
    lock still held (a network file system keeps a dead node's lock until its lease ends): SLURM never runs two
    incarnations of one job, so it takes over with a warning. Two runs of the same incarnation (two sruns in one
    allocation) are still refused."""
    run = tmp_path / "run"
    record = {"host": "node-a", "started": "2026-01-01T00:00:00Z", "slurm_job_id": "4242", "slurm_restart_count": 0}
    holder = hold_lock(run, record)
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        caplog.set_level(logging.INFO)
        code = main(None, overrides(run, data, **{"train.max_steps": 3}))
    finally:
        holder.kill()
        holder.wait(timeout=30)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if restart == "1":
        assert code == 0
        assert any("node-a" in m and "4242" in m and "requeue" in m for m in messages), messages
    else:
        assert code == 2
        assert any("host node-a" in m and f"pid {holder.pid}" in m for m in messages), messages
        assert not (run / "metrics.jsonl").exists()


@pytest.mark.dist
def test_two_ranks_are_one_run_and_a_refused_run_stops_on_every_rank(data, tmp_path):
    """Only rank 0 locks: with the lock held elsewhere, both ranks of a 2-rank torchrun stop with exit 2 (one line,
    bounded time, nothing written); with it free, both ranks train into the same run_dir to the end."""
    run = tmp_path / "run"
    command = overrides(run, data, **{"train.max_steps": 3})
    holder = hold_lock(run, {"host": "node-b", "started": "2026-01-01T00:00:00Z"})
    try:
        refused = train_ranks(2, command, timeout=120)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert refused.returncode != 0 and "exitcode  : 2" in refused.output, refused.output[-3000:]
    assert refused.output.count("is in use by another training (host node-b") == 1, refused.output[-3000:]
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    done = train_ranks(2, command, timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    assert logged_steps(run) == [1, 2, 3]


FORK_AND_EXIT = textwrap.dedent(
    """
    import fcntl, json, os, socket, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "-"}).encode())
    if os.fork() == 0:
        time.sleep(120)  # the child keeps the inherited lock, like a worker the run left behind
        os._exit(0)
    print("held", flush=True)
    """
)


def test_a_lock_kept_by_a_leftover_child_of_a_dead_holder_is_refused_with_the_way_to_find_it(data, tmp_path, caplog):
    """The holder (on this host) is gone but a process it forked still holds the lock: still refused, since that
    process may still write, and the line says the recorded pid no longer runs and how to find the one that does."""
    run = tmp_path / "run"
    run.mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-c", FORK_AND_EXIT, str(run / LOCK_FILE)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "held"
        assert parent.wait(timeout=30) == 0
        assert main(None, overrides(run, data, **{"train.max_steps": 3})) == 2
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"pid {parent.pid}" in errors[0], errors
    assert "no longer runs" in errors[0] and f"fuser {run / LOCK_FILE}" in errors[0], errors[0]
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]

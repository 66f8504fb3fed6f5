"""A start that cannot work says why in one line, exit 2, and leaves run_dir as it found it (issue 65, finding 7).

The single-process cases call the trainer's entry point in this process (what ``launch/pretrain.py`` runs), the
launcher case runs the commands a user types; the reference for "nothing left behind" is the folder's listing
before the start.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.config import load_config as load_prep_config
from pipeline.train import run_lock
from pipeline.train.trainer import main

REPO = Path(__file__).resolve().parents[2]
FAST = {"train.eval_every": 10, "checkpoint.export": False}
"""``train.eval_every`` > 0 as in configs/train/debug.yaml: its validation-split advice must not come first."""


def _pretrain(args: list[str], launcher: list[str] | None = None, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``launch/pretrain.py --config configs/train/debug.yaml args`` (under ``launcher``); exit code and output."""
    cmd = [*(launcher or [sys.executable]), "launch/pretrain.py", "--config", "configs/train/debug.yaml", *args]
    base = {k: v for k, v in os.environ.items() if k != "PIPE_FAULT"}
    done = subprocess.run(
        cmd, cwd=REPO, env={**base, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stdout + done.stderr


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "[ERROR]" in line]


def _start(args: list[str], caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    """The trainer's entry point with configs/train/debug.yaml and ``args``: exit code and the error lines (an
    exception escaping it, which a user would see as a traceback, fails the test)."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code = main(str(REPO / "configs/train/debug.yaml"), args)
    return code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_raw_text_folder_is_named_unprepared_first_with_the_prep_command_and_nothing_is_left(
    tmp_path, overrides, caplog
):
    raw = tmp_path / "books"
    raw.mkdir()
    for name in ("a.txt", "b.txt"):
        (raw / name).write_text("It was a dark and stormy night. " * 50)
    run = tmp_path / "run"
    # model.vocab_size as a user leaves it (the tests' 64 is below what prep trains): the advice names its size
    code, errors = _start([a for a in overrides(run, raw, **FAST) if not a.startswith("model.vocab_size=")], caplog)
    assert code == 2
    (line,) = errors
    assert f"data.path={raw} is not a prepared dataset" in line and "eval_every" not in line, line
    assert not run.exists(), sorted(p.name for p in run.iterdir())
    # The advice is a prep command whose keys prep takes: it reads the folder and writes somewhere else.
    found = re.search(r"prepare it with (launch/prep\.py [^,]*?), then", line)
    assert found is not None, line
    prep = load_prep_config(None, shlex.split(found.group(1))[1:])
    assert prep.input == [str(raw)] and not Path(prep.output).resolve().is_relative_to(raw)
    assert line.endswith(f"then set data.path={prep.output}"), line


def test_one_split_of_a_dataset_as_data_path_names_the_dataset(tmp_path, tiny_data, overrides, caplog):
    code, errors = _start(overrides(tmp_path / "run", tiny_data / "train", **FAST), caplog)
    assert code == 2
    (line,) = errors
    assert line.endswith(f"set data.path to the prepared dataset that holds it (data.path={tiny_data})"), line


@pytest.mark.parametrize("made_by_the_start", [True, False])
def test_a_refusal_after_the_lock_is_one_line_and_leaves_run_dir_as_it_was(
    tmp_path, tiny_data, overrides, caplog, made_by_the_start
):
    """A resume refused after run.lock was taken (here: ``checkpoint.resume`` names a save that never finished, a
    plain ``CheckpointError``): one line, exit 2; a run_dir this start made is gone, one the user made keeps only
    what it held."""
    unfinished = tmp_path / "step_00000004"
    unfinished.mkdir()
    run = tmp_path / "run"
    if not made_by_the_start:
        run.mkdir()
        (run / "notes.txt").write_text("mine")
    code, errors = _start(overrides(run, tiny_data, **FAST, **{"checkpoint.resume": unfinished}), caplog)
    assert code == 2
    assert errors == [f"checkpoint error: checkpoint.resume={unfinished}: no COMMITTED marker; the save never finished"]
    if made_by_the_start:
        assert not run.exists(), sorted(p.name for p in run.iterdir())
    else:
        assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_a_start_that_opened_the_lock_file_a_failed_start_removes_locks_the_new_one(tmp_path, monkeypatch):
    """A failed start removes its run.lock while another start has it open (`run_lock.RunLock.release`): the other
    start must not hold a lock on the removed file, which a third start could never see."""
    run = tmp_path / "run"
    failed = run_lock.acquire(run, {})
    real_open = run_lock.open_lock

    def open_then_the_failed_start_ends(path):
        fd = real_open(path)
        failed.release()  # it wrote nothing: its lock file and run_dir go
        return fd

    monkeypatch.setattr(run_lock, "open_lock", open_then_the_failed_start_ends)
    held = run_lock.acquire(run, {})
    monkeypatch.setattr(run_lock, "open_lock", real_open)
    try:
        with pytest.raises(run_lock.RunDirLockError, match="is in use by another training"):
            run_lock.acquire(run, {})
    finally:
        held.release()


@pytest.mark.dist
def test_a_two_rank_zero2_run_resumed_without_the_launcher_is_one_line(tmp_path, tiny_data, overrides, clean_shm):
    """The likeliest resume mistake: a run of ``deepspeed --num_gpus 2`` (ZeRO-2, optimizer state partitioned over
    2 ranks) resumed with plain ``python``. The refusal names both world sizes and the fix, with no traceback."""
    run = tmp_path / "run"
    args = [
        "parallel.engine=deepspeed",
        "parallel.zero_stage=2",
        *overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.every": 3, **FAST}),
    ]
    env = {"DS_ACCELERATOR": "cpu"}
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2"]
    code, out = _pretrain(args, launcher=deepspeed, env=env)
    assert code == 0, out[-4000:]
    code, out = _pretrain([*args, "train.max_steps=6"], env=env)
    assert code == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    (line,) = _error_lines(out)
    assert line.endswith(
        f"checkpoint error: {run / 'checkpoints/step_00000003'} holds DeepSpeed ZeRO-2 optimizer state partitioned "
        "over 2 ranks; this run has 1. Resume with 2 ranks (the data position would carry over, but DeepSpeed cannot "
        "re-partition this optimizer state here), or convert it with DeepSpeed's ds_to_universal.py"
    ), line

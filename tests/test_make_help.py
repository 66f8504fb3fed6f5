"""``make help`` lists every job of the Makefile with one line, and the training and prep targets take the config,
data and run directory as variables while their defaults run what they always ran.

The targets are read with ``make -n`` (print the commands, run none), so no venv is installed or changed here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"


def make(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MAKELEVEL", "MFLAGS"}}
    for name in (
        "CONFIG",
        "DATA",
        "RUN",
        "ARGS",
        "INPUT",
        "OUTPUT",
        "VOCAB",
        "EVAL",
    ):  # a user's shell may export these
        env.pop(name, None)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def phony_targets() -> list[str]:
    return [t for line in re.findall(r"(?m)^\.PHONY:(.*)$", MAKEFILE.read_text()) for t in line.split()]


def help_lines() -> dict[str, str]:
    done = make("-s", "help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(re.match(r"^  \S+ +\S", line) for line in lines), lines
    return {line.split()[0]: line.split(None, 1)[1] for line in lines}


def launched(*args: str) -> list[str]:
    """The words of the command a target runs that starts a launch script (continuation lines joined)."""
    done = make("-n", *args)
    assert done.returncode == 0, done.stderr
    commands = done.stdout.replace("\\\n", " ").splitlines()
    found = [c for c in commands if "launch/" in c]
    assert len(found) == 1, done.stdout
    return shlex.split(found[0])


def test_every_target_has_one_help_line():
    targets = phony_targets()
    listed = help_lines()
    assert sorted(listed) == sorted(targets), set(listed) ^ set(targets)
    rules = set(re.findall(r"(?m)^([a-zA-Z0-9_-]+):", MAKEFILE.read_text()))
    assert set(targets) <= rules


def test_help_installs_nothing():
    done = make("-n", "help")
    assert "pip" not in done.stdout and "venv" not in done.stdout, done.stdout


VENV_PY = ".venv/bin/python"


@pytest.mark.parametrize("target", ["train", "train-debug"])
def test_train_defaults_to_the_debug_run(target):
    assert launched(target) == [VENV_PY, "launch/pretrain.py", "--config", "configs/train/debug.yaml"]


def test_train_takes_config_data_run_and_args():
    args = ["CONFIG=configs/train/tiny.yaml", "DATA=data/mine", "RUN=runs/mine", "ARGS=train.max_steps=3 seed=1"]
    assert launched("train", *args) == [
        VENV_PY,
        "launch/pretrain.py",
        "--config",
        "configs/train/tiny.yaml",
        "data.path=data/mine",
        "run_dir=runs/mine",
        "train.max_steps=3",
        "seed=1",
    ]


def test_the_two_rank_targets_take_the_same_variables():
    ds = launched("train-ds-cpu", "CONFIG=configs/train/tiny.yaml", "DATA=data/mine")
    assert ds[:5] == ["DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1", ".venv/bin/deepspeed", "--num_gpus", "2"]
    assert ds[5:] == [
        "launch/pretrain.py",
        "--config",
        "configs/train/tiny.yaml",
        "data.path=data/mine",
        "parallel.engine=deepspeed",
        "parallel.zero_stage=2",
    ]
    assert launched("train-fsdp-cpu")[-3:] == ["--config", "configs/train/debug.yaml", "parallel.engine=fsdp"]


def test_prep_text_needs_input_and_output():
    assert launched("prep-text", "INPUT=books", "OUTPUT=data/books") == [
        VENV_PY,
        "launch/prep.py",
        "input=books",
        "output=data/books",
        "tokenizer.vocab_size=8000",
    ]
    refused = make("-n", "prep-text", "INPUT=books")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "INPUT=" in lines[0] and "OUTPUT=" in lines[0], lines
    assert launched("prep") == [VENV_PY, "launch/prep.py", "--config", "configs/data/default.yaml"]


def test_report_needs_the_eval_directory():
    assert launched("report", "EVAL=out/a out/b") == [VENV_PY, "launch/report.py", "out/a", "out/b"]
    refused = make("-n", "report")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "EVAL=" in lines[0], lines

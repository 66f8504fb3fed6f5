"""T1 (exact resume), T2 (SIGKILL a rank), T3 (os._exit inside a save), T17 (preemption signal, twice): two ranks.

Each interrupted run is relaunched with the very same command (autoresume, no manual cleanup) and must end
bitwise equal to the uninterrupted two-rank run: per-step loss, gradient norm and LR (``float.hex``), and the
final model, optimizer, per-rank RNG and data-loader state (``torch.equal``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from reliability_harness import (
    assert_same_checkpoint,
    assert_same_steps,
    committed,
    overrides,
    read_metrics,
    train_ranks,
)

from pipeline.train import dist
from pipeline.train.checkpoint import verify_integrity

pytestmark = [pytest.mark.reliability, pytest.mark.dist]

STEPS = 16
ARGS = {"train.max_steps": STEPS, "checkpoint.every": 4}
FINAL = f"checkpoints/step_{STEPS:08d}"
ONE_RANK = dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data) -> Path:
    """Run A: two ranks (DDP over gloo), 16 steps, a checkpoint every 4, never interrupted."""
    run = tmp_path_factory.mktemp("straight") / "run"
    result = train_ranks(2, overrides(run, data, **ARGS))
    assert result.returncode == 0, result.output[-4000:]
    return run


def _launches(run: Path) -> list[tuple[int, list[int]]]:
    """Per launch recorded in metrics.jsonl: its start step and the steps it logged."""
    launches: list[tuple[int, list[int]]] = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "start_step" in record:
            launches.append((record["start_step"], []))
        elif "loss" in record:
            launches[-1][1].append(record["step"])
    return launches


def _relaunch_and_compare(run: Path, data: Path, straight: Path, resumed_from: int) -> None:
    again = train_ranks(2, overrides(run, data, **ARGS))
    assert again.returncode == 0, again.output[-4000:]
    (start_a, _), (start_b, steps_b) = _launches(run)
    assert (start_a, start_b) == (0, resumed_from)
    assert steps_b == list(range(resumed_from + 1, STEPS + 1)), "the counter continues: no step repeated or skipped"
    assert_same_steps(straight, run, range(1, STEPS + 1))
    assert_same_checkpoint(straight / FINAL, run / FINAL)


def test_t01_exact_resume_same_world_size(straight, data, tmp_path):
    """Run B stops cleanly right after the step-8 checkpoint (stop request at step 8); the relaunch continues at 9."""
    run = tmp_path / "run"
    first = train_ranks(2, overrides(run, data, **ARGS), fault="sigusr1:step=8:rank=0")
    assert first.returncode != 0 and re.search(r"exitcode\s*:\s*75", first.output), first.output[-3000:]
    assert committed(run) == ["step_00000004", "step_00000008"]
    assert max(read_metrics(run)) == 8
    _relaunch_and_compare(run, data, straight, resumed_from=8)


def test_t02_sigkill_a_rank_then_autoresume(straight, data, tmp_path):
    run = tmp_path / "run"
    first = train_ranks(2, overrides(run, data, **ARGS), fault="kill:step=7:rank=1")
    assert first.returncode != 0
    assert committed(run) == ["step_00000004"]
    _relaunch_and_compare(run, data, straight, resumed_from=4)


def test_t03_os_exit_inside_a_save_on_one_rank(straight, data, tmp_path):
    """Rank 0 dies inside the step-8 save with only the engine state written: the torn step_8.tmp is never
    selected, is removed at the relaunch, and the run resumes from step 4."""
    run = tmp_path / "run"
    first = train_ranks(2, overrides(run, data, **ARGS), fault="exit_during_save:step=8:rank=0:at=engine")
    assert first.returncode != 0
    assert committed(run) == ["step_00000004"]
    assert (run / "checkpoints/step_00000008.tmp/state.pt").is_file(), "the save was torn after the engine state"
    _relaunch_and_compare(run, data, straight, resumed_from=4)
    assert not (run / "checkpoints/step_00000008.tmp").exists()


def test_t17_preemption_signal_on_one_rank_arriving_twice(straight, data, tmp_path):
    """SIGUSR1 reaches rank 1 only, after step 5; a SIGTERM reaches rank 0 in the middle of the save. Both ranks
    stop at the same step boundary, write one consistent checkpoint, exit with the requeue code (75); the
    relaunch ends bitwise equal to the uninterrupted run."""
    run = tmp_path / "run"
    fault = "sigusr1:step=5:rank=1,signal_during_save:step=5:rank=0:at=engine:sig=term"
    first = train_ranks(2, overrides(run, data, **ARGS), fault=fault)
    assert first.returncode != 0 and re.search(r"exitcode\s*:\s*75", first.output), first.output[-3000:]
    assert committed(run) == ["step_00000004", "step_00000005"]
    assert first.output.count("checkpoint step 5 committed") == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]
    verify_integrity(run / "checkpoints/step_00000005", ONE_RANK)
    _relaunch_and_compare(run, data, straight, resumed_from=5)


def test_t02_default_export_sigkill_between_checkpoints(data, tmp_path):
    """With the eval export on (the default; rank 0 builds an export model inside every save), a run saving every
    2 steps and a run saving every 5 whose rank 1 is SIGKILLed at step 7 (not a checkpoint step) and relaunched
    give hex-identical losses and equal final states: nothing outside the training step draws from the RNG."""
    common = {"train.max_steps": 10, "checkpoint.export": True}
    every2, killed = tmp_path / "every2", tmp_path / "killed"
    straight = train_ranks(2, overrides(every2, data, **common, **{"checkpoint.every": 2}))
    assert straight.returncode == 0, straight.output[-4000:]
    command = overrides(killed, data, **common, **{"checkpoint.every": 5})
    assert train_ranks(2, command, fault="kill:step=7:rank=1").returncode != 0
    assert committed(killed) == ["step_00000005"]
    again = train_ranks(2, command)
    assert again.returncode == 0, again.output[-4000:]
    assert [start for start, _ in _launches(killed)] == [0, 5]
    assert_same_steps(every2, killed, range(1, 11))
    assert_same_checkpoint(every2 / "checkpoints/step_00000010", killed / "checkpoints/step_00000010")

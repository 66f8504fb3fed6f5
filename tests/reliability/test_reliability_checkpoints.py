"""T3 (torn save, every save point, in-process), T4 (corruption detection), T5 (retention): one process, fast.

The multi-rank torn save with a real ``os._exit`` is in test_reliability_resume_dist.py. Here ``os._exit`` is
replaced by an exception, which leaves exactly the files a hard crash at that point leaves (nothing in the save
runs after the fault point), so every point of the save can be covered in a few seconds.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from reliability_harness import assert_same_checkpoint, assert_same_steps, committed, flip_byte, overrides

from pipeline.train import dist, faults
from pipeline.train.checkpoint import COMMIT_MARKER, INTEGRITY_FILE
from pipeline.train.parallel import TorchEngine
from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability


class _Crash(BaseException):
    """Stands in for os._exit: not an Exception, so no handler in the trainer catches it."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data) -> Path:
    """The uninterrupted reference: 12 steps, a checkpoint every 4."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(None, overrides(run, data, **{"train.max_steps": 12})) == 0
    return run


@pytest.mark.parametrize("point", faults.SAVE_POINTS)
def test_t03_torn_save_is_never_selected(point, straight, data, tmp_path, monkeypatch):
    """A crash inside the step-8 save, at each point of it: step 8 is never resumed from, the good step-4
    checkpoint is never purged in its place (keep_last=1), the leftover is removed, and the resumed run ends
    bitwise equal to the uninterrupted one."""
    run = tmp_path / "run"
    args = overrides(run, data, **{"train.max_steps": 12, "checkpoint.keep_last": 1})

    def crash(code: int) -> None:
        raise _Crash(code)

    monkeypatch.setattr(faults.os, "_exit", crash)
    monkeypatch.setenv("PIPE_FAULT", f"exit_during_save:step=8:at={point}")
    with pytest.raises(_Crash):
        main(None, args)
    assert committed(run) == ["step_00000004"]
    leftover = run / "checkpoints" / ("step_00000008" if point == "renamed" else "step_00000008.tmp")
    assert leftover.is_dir() and not (leftover / COMMIT_MARKER).exists()
    monkeypatch.delenv("PIPE_FAULT")
    assert main(None, args) == 0
    assert committed(run) == ["step_00000012"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000012"]
    start = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"start_step"' in line]
    assert [s["start_step"] for s in start] == [0, 4], "resumed from step 4, not from the torn step 8"
    assert_same_steps(straight, run, range(1, 13))
    assert_same_checkpoint(straight / "checkpoints/step_00000012", run / "checkpoints/step_00000012")


@pytest.fixture
def two_checkpoints(data, tmp_path) -> Path:
    run = tmp_path / "run"
    assert main(None, overrides(run, data)) == 0  # 8 steps: checkpoints at 4 and 8
    assert committed(run) == ["step_00000004", "step_00000008"]
    return run


def _resume_args(run: Path, data: Path) -> list[str]:
    return overrides(run, data, **{"train.max_steps": 12})


@pytest.fixture
def no_engine_load(monkeypatch):
    """Fail if any tensor is loaded into the model (verification must happen first)."""
    calls = []
    real = TorchEngine.load

    def spy(self, directory):
        calls.append(directory)
        return real(self, directory)

    monkeypatch.setattr(TorchEngine, "load", spy)
    return calls


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "add_file", "delete_file", "delete_manifest"])
def test_t04_corruption_is_caught_before_load_naming_the_file(damage, two_checkpoints, data, no_engine_load, caplog):
    """With checkpoint.fallback_to_previous=false the run stops there (exit 2, one line); by default it falls back
    (below)."""
    ckpt = two_checkpoints / "checkpoints/step_00000008"
    target = ckpt / "state.pt"
    before = target.read_bytes()
    if damage == "flip":
        flip_byte(target)
        match = r"state\.pt: sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"
    elif damage == "truncate":
        target.write_bytes(before[: len(before) // 2])
        match = rf"state\.pt: size {len(before) // 2} bytes, expected {len(before)} \(truncated"
    elif damage == "append":
        target.write_bytes(before + b"\0")
        match = rf"state\.pt: size {len(before) + 1} bytes, expected {len(before)}"
    elif damage == "add_file":
        (ckpt / "extra.pt").write_bytes(b"x")
        match = r"extra\.pt: not listed in integrity\.json"
    elif damage == "delete_file":
        (ckpt / "rng_rank0.pt").unlink()
        match = r"rng_rank0\.pt: listed in integrity\.json but missing"
    else:
        (ckpt / INTEGRITY_FILE).unlink()
        match = "missing integrity manifest"
    with caplog.at_level(logging.ERROR):
        assert main(None, [*_resume_args(two_checkpoints, data), "checkpoint.fallback_to_previous=false"]) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert re.search(match, line) and "step_00000008" in line, line
    assert no_engine_load == [], "no tensor may reach the model before verification"


def test_t04_fallback_to_previous_verified_checkpoint(two_checkpoints, data, caplog):
    """By default (checkpoint.fallback_to_previous), a corrupt newest checkpoint is set aside with a warning; the
    run resumes from step 4 and ends equal to a run that never had the corrupt checkpoint."""
    flip_byte(two_checkpoints / "checkpoints/step_00000008/state.pt")
    with caplog.at_level(logging.WARNING):
        assert main(None, _resume_args(two_checkpoints, data)) == 0
    assert "failed verification" in caplog.text and "set aside as" in caplog.text
    assert "resuming from" in caplog.text and "step_00000004" in caplog.text
    starts = [
        json.loads(line)["start_step"]
        for line in (two_checkpoints / "metrics.jsonl").read_text().splitlines()
        if '"start_step"' in line
    ]
    assert starts == [0, 4]


def test_t05_keep_last_n(data, tmp_path, monkeypatch, caplog):
    """keep_last=3 with a save every step: exactly the 3 newest remain. A delete that fails is a warning,
    training goes on, later purges still run, and the in-progress save is never touched by a purge."""
    import pipeline.train.checkpoint as checkpoint

    run = tmp_path / "run"
    real_rmtree = checkpoint.shutil.rmtree
    removed: list[str] = []

    def rmtree(path, *args, **kwargs):
        name = Path(path).name
        if name == "step_00000002" and not kwargs.get("ignore_errors"):
            raise PermissionError(13, "Permission denied", str(path))
        removed.append(name)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING):
        assert main(None, overrides(run, data, **{"checkpoint.every": 1, "checkpoint.keep_last": 3})) == 0
    assert committed(run) == ["step_00000006", "step_00000007", "step_00000008"]
    assert "could not delete old checkpoint" in caplog.text and "step_00000002" in caplog.text
    # Its marker went first, so the undeletable directory is no longer a checkpoint (removed at the next start).
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000006",
        "step_00000007",
        "step_00000008",
    ]
    purged = [n for n in removed if n.startswith("step_") and not n.endswith(".tmp")]  # not the reader's cache
    assert purged == [f"step_{s:08d}" for s in (1, 3, 4, 5)], purged
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert (
        main(None, overrides(run, data, **{"checkpoint.every": 1, "checkpoint.keep_last": 1, "train.max_steps": 9}))
        == 0
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000009"]


def _reparallel(run: Path, engine: str, zero_stage: int, world_size: int) -> Path:
    """Rewrite a checkpoint's recorded layout (and reseal it), as if another engine / world size had saved it."""
    from pipeline.train.checkpoint import write_integrity

    ckpt = run / "checkpoints/step_00000008"
    path = ckpt / "trainer_state.json"
    state = json.loads(path.read_text())
    state.update(parallel={"engine": engine, "zero_stage": zero_stage}, world_size=world_size)
    path.write_text(json.dumps(state))
    write_integrity(ckpt, dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    return ckpt


@pytest.mark.parametrize(
    "engine, zero_stage, world, current, match",
    [
        (
            "deepspeed",
            2,
            2,
            {"engine": "deepspeed", "zero_stage": 2},
            r"DeepSpeed ZeRO-2 optimizer state partitioned over 2 ranks; this run has 1\. Resume with 2 ranks",
        ),
        (
            "none",
            0,
            1,
            {"engine": "fsdp", "zero_stage": 0},
            r"written by parallel\.engine=none \(zero_stage=0\), this run uses parallel\.engine=fsdp",
        ),
        ("deepspeed", 1, 1, {"engine": "deepspeed", "zero_stage": 3}, r"zero_stage=1\), this run uses .*zero_stage=3"),
    ],
)
def test_t07_layouts_that_cannot_be_resharded_are_refused(engine, zero_stage, world, current, match, two_checkpoints):
    """T7's refusal half (the re-sharding runs are in test_reliability_world_size_dist.py): DeepSpeed ZeRO-1/2/3
    optimizer partitions cannot move to another world size here, and no engine reads another engine's format."""
    from pipeline.train.checkpoint import CheckpointError, CheckpointManager

    ckpt = _reparallel(two_checkpoints, engine, zero_stage, world)
    info = dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    model_config = json.loads((ckpt / "trainer_state.json").read_text())["model_config"]
    with pytest.raises(CheckpointError, match=match):
        CheckpointManager(two_checkpoints, 3, info).read_state(ckpt, model_config, current)

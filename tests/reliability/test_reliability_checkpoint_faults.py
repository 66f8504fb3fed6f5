"""Checkpoint faults met by a real run (issue 51): a save that cannot write (disk full, a file-size limit, a
permission) is one line naming the cause, the file and the last good checkpoint, and nothing already written is
lost; a damaged or crafted newest checkpoint is named in one line, set aside unread and kept, and the run resumes
from the newest intact one (``checkpoint.fallback_to_previous=false``: refused instead).

Every run keeps the trainer's defaults that matter here (eval export on, default ``keep_last`` and backends) on
the tiny model and dataset of reliability_harness.py, saving every 4 steps. The reference is an independent
uninterrupted run; the faults are real where that is cheap on CPU as root (``prlimit --fsize``: Python ignores
SIGXFSZ, so the write fails with EFBIG, as on a file system with a file-size limit) and injected at the writing
call otherwise (root writes through a read-only mode, and a full disk would need a file system of its own).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from reliability_harness import (
    CONFIG,
    REPO,
    assert_same_checkpoint,
    assert_same_steps,
    committed,
    flip_byte,
    overrides,
    run_process,
    train_ranks,
)
from safetensors import SafetensorError

from pipeline.train import dist
from pipeline.train.checkpoint import verify_integrity, write_integrity
from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability

STEPS = 8
_HARNESS_CHOICES = ("checkpoint.export", "checkpoint.keep_last", "model.gca_backend", "model.swa_backend")
"""Settings the harness pins for speed; these runs leave them at the trainer's defaults."""
ONE_RANK = dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def args(run: Path, data: Path, **extra: object) -> list[str]:
    """The harness's tiny model, a checkpoint every 4 steps, the trainer's default export and backend settings."""
    base = overrides(run, data, **{"train.max_steps": STEPS, "checkpoint.every": 4})
    pinned = [a for a in base if a.split("=", 1)[0] not in _HARNESS_CHOICES]
    return [*pinned, *(f"{k}={v}" for k, v in extra.items())]


def starts(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [int(re.search(r'"start_step": (\d+)', line)[1]) for line in lines if '"start_step"' in line]


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(None, args(run, data)) == 0
    return run


def assert_relaunch_finishes_like_the_reference(run: Path, data: Path, reference: Path) -> None:
    """The same command again, the fault gone: it resumes from step 4 and ends equal to the uninterrupted run."""
    assert main(None, args(run, data)) == 0
    assert starts(run)[-1] == 4
    assert committed(run) == ["step_00000004", "step_00000008"]
    assert_same_steps(reference, run, range(1, STEPS + 1))
    assert_same_checkpoint(reference / "checkpoints/step_00000008", run / "checkpoints/step_00000008")


# -- a save that cannot write ----------------------------------------------------------------------------------------


def _disk_full_in_the_export(monkeypatch) -> str:
    """The safetensors writer on a full disk: part of the file is written, then its own error (no file named)."""
    real = safetensors.torch.save_model

    def save_model(model, filename, *a, **kw):
        if "step_00000008" not in filename:
            return real(model, filename, *a, **kw)
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_model", save_model)
    return r"No space left on device \(errno 28\) writing \S+/step_00000008\.tmp/export/model\.safetensors;"


def _permission_denied_on_the_engine_state(monkeypatch) -> str:
    real = torch.save

    def save(obj, f, *a, **kw):
        if "step_00000008" in str(f):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(f))
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    return r"Permission denied \(errno 13\) writing \S+/step_00000008\.tmp/state\.pt"


@pytest.mark.parametrize("fault", [_disk_full_in_the_export, _permission_denied_on_the_engine_state])
def test_a_save_that_cannot_write_is_one_line_and_the_last_checkpoint_survives(
    fault, reference, data, tmp_path, monkeypatch, caplog
):
    """Before: the SafetensorError or PermissionError left ``main`` as a traceback. Now: exit 1 and one line with
    the cause, the file and the last good checkpoint; step 4 still verifies and the relaunch ends exactly."""
    run = tmp_path / "run"
    names_cause_and_file = fault(monkeypatch)
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data)) == 1
    [line] = errors(caplog)
    assert "\n" not in line
    assert re.search(rf"checkpoint save of step 8 failed: {names_cause_and_file}", line), line
    assert re.search(r"the last good checkpoint is step 4 \(\S+/checkpoints/step_00000004\)", line), line
    assert committed(run) == ["step_00000004"]
    verify_integrity(run / "checkpoints/step_00000004", ONE_RANK)
    monkeypatch.undo()
    assert_relaunch_finishes_like_the_reference(run, data, reference)


def test_a_file_size_limit_during_a_save_is_one_line_not_torchs_unexpected_pos(reference, data, tmp_path, monkeypatch):
    """A real EFBIG: a run stopped after step 4 (a Ctrl-C: saved, exit 130) is relaunched under a file-size limit
    below the size of its engine state. Before: torch's ``RuntimeError: ... unexpected pos N vs M`` traceback,
    naming neither the cause nor the file."""
    run = tmp_path / "run"
    monkeypatch.setenv("PIPE_FAULT", "sigint:step=4")
    assert main(None, args(run, data)) == 130
    monkeypatch.delenv("PIPE_FAULT")
    step4 = run / "checkpoints/step_00000004"
    before = tree(step4)
    limit = (step4 / "state.pt").stat().st_size // 2
    launch = [sys.executable, str(REPO / "launch/pretrain.py"), "--config", CONFIG, *args(run, data)]
    result = run_process(["prlimit", f"--fsize={limit}", *launch], timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    [line] = [line for line in result.output.splitlines() if "[ERROR]" in line]
    assert re.search(
        rf"checkpoint save of step 8 failed: the file-size limit \(ulimit -f, {limit} bytes\) was reached writing "
        r"\S+/step_00000008\.tmp/state\.pt",
        line,
    ), line
    assert re.search(r"the last good checkpoint is step 4 \(\S+/checkpoints/step_00000004\)", line), line
    assert tree(step4) == before
    assert_relaunch_finishes_like_the_reference(run, data, reference)


# -- a damaged or crafted newest checkpoint --------------------------------------------------------------------------


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _flipped_byte(ckpt: Path, marker: Path) -> str:
    flip_byte(ckpt / "state.pt")
    return r"state\.pt: sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"


def _crafted_pickle(ckpt: Path, marker: Path) -> str:
    """An attacker who can write the run directory: a payload in state.pt and the integrity manifest resealed."""
    torch.save({"model": Payload(marker)}, ckpt / "state.pt")
    write_integrity(ckpt, ONE_RANK)
    return r"state\.pt: refusing to load: .*GLOBAL posix\.system"


@pytest.fixture
def damaged_newest(request, data, tmp_path) -> tuple[Path, str, dict[str, bytes]]:
    """A run saved at steps 4 and 8, its step 8 then damaged by ``request.param``: the run, the pattern naming why
    step 8 is refused, and step 8's files as they are after the damage."""
    run = tmp_path / "run"
    assert main(None, args(run, data)) == 0
    newest = run / "checkpoints/step_00000008"
    why = request.param(newest, tmp_path / "MARKER")
    return run, why, tree(newest)


@pytest.mark.parametrize("damaged_newest", [_flipped_byte, _crafted_pickle], indirect=True)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_newest_intact_one(
    damaged_newest, reference, data, tmp_path, caplog
):
    """Before: ``CheckpointCorruptError`` / ``UnsafeCheckpointError`` tracebacks, though step 4 was intact. Now, by
    default: one warning line naming step 8 and why, step 8 renamed aside unread and byte for byte kept (the
    relaunch saves a new step 8 beside it), and the run resumes from step 4 to the uninterrupted run's end."""
    run, why, damaged = damaged_newest
    with caplog.at_level(logging.WARNING):
        assert main(None, args(run, data)) == 0
    assert errors(caplog) == []
    [line] = [r.getMessage() for r in caplog.records if "not resuming from" in r.getMessage()]
    assert re.search(rf"not resuming from \S+/checkpoints/step_00000008: .*{why}", line), line
    assert re.search(r"set aside as \S+/checkpoints/step_00000008\.rejected \(kept", line), line
    assert re.search(r"resuming from \S+/checkpoints/step_00000004 \(step 4\)", line), line
    assert "checkpoint.fallback_to_previous=false" in line and "\n" not in line
    assert not (tmp_path / "MARKER").exists(), "the crafted pickle ran"
    assert tree(run / "checkpoints/step_00000008.rejected") == damaged
    assert starts(run) == [0, 4]
    assert_same_steps(reference, run, range(1, STEPS + 1))
    assert_same_checkpoint(reference / "checkpoints/step_00000008", run / "checkpoints/step_00000008")


@pytest.mark.parametrize("damaged_newest", [_flipped_byte, _crafted_pickle], indirect=True)
def test_fallback_to_previous_false_refuses_in_one_line_and_changes_nothing(damaged_newest, data, tmp_path, caplog):
    run, why, _ = damaged_newest
    before = tree(run / "checkpoints")
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data, **{"checkpoint.fallback_to_previous": "false"})) == 2
    [line] = errors(caplog)
    assert re.search(rf"\S+/checkpoints/step_00000008\b.*{why}", line), line
    assert "checkpoint.fallback_to_previous=false" in line and "\n" not in line
    assert tree(run / "checkpoints") == before
    assert not (tmp_path / "MARKER").exists(), "the crafted pickle ran"
    assert starts(run) == [0]


@pytest.mark.dist
def test_two_ranks_set_the_damaged_checkpoint_aside_together_and_resume_from_the_intact_one(data, tmp_path):
    """Rank 0 renames, every rank waits for it (a broadcast) and loads step 4; neither rank sees step 8."""
    run = tmp_path / "run"
    assert train_ranks(2, args(run, data)).returncode == 0
    flip_byte(run / "checkpoints/step_00000008/state.pt")
    damaged = tree(run / "checkpoints/step_00000008")
    again = train_ranks(2, args(run, data))
    assert again.returncode == 0, again.output[-3000:]
    assert len(re.findall(r"\[WARNING\] .*not resuming from \S+/step_00000008: ", again.output)) == 1
    assert starts(run) == [0, 4]
    assert committed(run) == ["step_00000004", "step_00000008", "step_00000008.rejected"]
    assert tree(run / "checkpoints/step_00000008.rejected") == damaged


@pytest.mark.dist
def test_a_save_only_rank_0_cannot_write_stops_both_ranks_with_one_line(data, tmp_path):
    """A real ``ulimit -f`` below the size of the trainer state, which only rank 0 writes. Before: two error lines,
    rank 1's blaming the file-size limit for a gloo "Connection closed by peer" (under NCCL it would have waited
    for the collective timeout). Now the ranks agree on the outcome of each part of the save: exit 1, one line
    naming rank 0, the cause, the file and the last good checkpoint, which is untouched."""
    run = tmp_path / "run"
    first = train_ranks(2, args(run, data, **{"train.max_steps": 4}))
    assert first.returncode == 0, first.output[-3000:]
    step4 = run / "checkpoints/step_00000004"
    before = tree(step4)
    limit = (step4 / "state.pt").stat().st_size // 2
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launch = [*torchrun, "--max-restarts", "0", str(REPO / "launch/pretrain.py"), "--config", CONFIG]
    result = run_process(["prlimit", f"--fsize={limit}", *launch, *args(run, data)], timeout=180)
    assert result.returncode == 1, result.output[-3000:]
    [line] = [line for line in result.output.splitlines() if "[ERROR] pipeline" in line]
    assert re.search(
        rf"checkpoint save of step 8 failed on rank 0: the file-size limit \(ulimit -f, {limit} bytes\) was reached "
        r"writing \S+/step_00000008\.tmp/state\.pt",
        line,
    ), line
    assert re.search(r"the last good checkpoint is step 4 \(\S+/checkpoints/step_00000004\)", line), line
    # torchrun's own report of a child's non-zero exit (ChildFailedError) follows; no traceback from the trainer.
    assert "Connection closed" not in result.output and "/pipeline/" not in result.output, result.output[-3000:]
    assert tree(step4) == before

"""T7: resume on a different world size. Model, optimizer and data position carry over exactly (checked at load
time against the saved state), the global batches are the same sequences (the loader state is a global cursor,
T9), and the losses match the uninterrupted run within rtol 1e-5 (the reduction order changes, so not bitwise).
Gumbel top-k noise is drawn per rank, so it is off here; RNG streams of ranks that did not exist restart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reliability_harness import committed, overrides, read_metrics, train_ranks
from safetensors.torch import load_file

from pipeline.train import dist
from pipeline.train.config import load_config
from pipeline.train.trainer import Trainer, main

pytestmark = [pytest.mark.reliability, pytest.mark.dist]

ARGS = {"train.max_steps": 16, "checkpoint.every": 4, "model.gumbel_topk": False}


def _data_state(run: Path, step: int) -> dict:
    return json.loads((run / f"checkpoints/step_{step:08d}/trainer_state.json").read_text())["data"]


def _close_losses(reference: Path, run: Path, steps: range) -> None:
    ref, got = read_metrics(reference), read_metrics(run)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert got[step]["lr"] == ref[step]["lr"], step


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data) -> Path:
    run = tmp_path_factory.mktemp("two_ranks") / "run"
    result = train_ranks(2, overrides(run, data, **ARGS))
    assert result.returncode == 0, result.output[-4000:]
    return run


def test_t07_ddp_two_ranks_to_one(two_ranks, data, tmp_path):
    run = Path(shutil.copytree(two_ranks, tmp_path / "run"))
    for late in ("step_00000012", "step_00000016"):
        shutil.rmtree(run / "checkpoints" / late)
    cfg = load_config(None, overrides(run, data, **ARGS))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    assert trainer.resume() and trainer.step == 8
    saved = torch.load(run / "checkpoints/step_00000008/state.pt", weights_only=True)
    live = trainer.engine.module.state_dict()
    assert all(torch.equal(live[k], v) for k, v in saved["model"].items()), "model restored exactly"
    optim = trainer.engine.optimizer.state_dict()
    assert all(torch.equal(optim["state"][p][k], v) for p, s in saved["optim"]["state"].items() for k, v in s.items())
    assert trainer.batches.state_dict() == _data_state(run, 8), "data position restored, not reset"
    assert trainer.train() == 0
    _close_losses(two_ranks, run, range(9, 17))
    for step in (12, 16):
        assert _data_state(run, step) == _data_state(two_ranks, step), "the same sequences were consumed"


def test_t07_ddp_one_rank_to_two(two_ranks, data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("PIPE_FAULT", "sigusr1:step=8")
    assert main(None, overrides(run, data, **ARGS)) == 75
    monkeypatch.delenv("PIPE_FAULT")
    _close_losses(two_ranks, run, range(1, 9))
    result = train_ranks(2, overrides(run, data, **ARGS))
    assert result.returncode == 0, result.output[-4000:]
    assert "saved by 1 ranks, resuming on 2" in result.output
    _close_losses(two_ranks, run, range(9, 17))
    for step in (12, 16):
        assert _data_state(run, step) == _data_state(two_ranks, step)


def test_t07_fsdp_two_ranks_to_one(two_ranks, data, tmp_path):
    """FSDP2's DCP checkpoint is re-sharded on load: the gathered weights at load time equal the weights saved
    (the checkpoint's eval export), and the run continues like the DDP reference."""
    run = tmp_path / "run"
    fsdp = {**ARGS, "parallel.engine": "fsdp", "checkpoint.export": True}
    first = train_ranks(2, overrides(run, data, **fsdp), fault="sigusr1:step=8:rank=1")
    assert "exitcode" in first.output and committed(run)[-1] == "step_00000008", first.output[-3000:]
    info = dist.init_distributed("fsdp")
    try:
        trainer = Trainer(load_config(None, overrides(run, data, **fsdp)), info)
        assert trainer.resume() and trainer.step == 8
        saved = load_file(run / "checkpoints/step_00000008/export/model.safetensors")
        live = trainer.engine.full_state_dict()
        assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in saved)
        assert trainer.batches.state_dict() == _data_state(run, 8)
        assert trainer.train() == 0
    finally:
        dist.destroy()
    _close_losses(two_ranks, run, range(1, 17))
    assert _data_state(run, 16) == _data_state(two_ranks, 16)

"""One failure, one line (issue 62, finding 5): an error every rank of a torchrun job hits alike (a configuration
error before the process group, a refused resume after it) is said once for the job, not once per rank; an error
that differs from rank to rank is still said by each rank that has it."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed
from torchrun_jobs import run_job, torchrun_cmd

from pipeline.train import dist

FAST = {"train.eval_every": 0, "checkpoint.every": 4, "checkpoint.export": False}


def _launch(nproc: int, args: list[str]) -> tuple[int, str]:
    """``torchrun --standalone`` with ``nproc`` ranks (a plain ``python`` for 0), killed past 120 s (a failure);
    returns the exit code and everything it printed."""
    plain = [sys.executable, "launch/pretrain.py", "--config", "configs/train/debug.yaml", *args]
    cmd = torchrun_cmd(nproc, args) if nproc else plain
    env = {**{k: v for k, v in os.environ.items() if k != "PIPE_FAULT"}, "OMP_NUM_THREADS": "1"}
    code, out, _ = run_job(cmd, env, timeout=120)
    return code, out


def test_a_configuration_error_of_three_ranks_is_said_once(tmp_path, tiny_data, overrides):
    code, out = _launch(3, overrides(tmp_path / "run", tiny_data, **{**FAST, "train.max_steps": -1}))
    assert code != 0 and "exitcode  : 2" in out, out[-4000:]
    assert out.count("configuration error: train.max_steps must be >= 1; got -1") == 1, out[-4000:]


@pytest.mark.dist
def test_a_refused_resume_of_two_ranks_is_said_once(tmp_path, tiny_data, overrides):
    """After the process group exists: both ranks refuse the same checkpoint for the same changed key."""
    run = tmp_path / "run"
    code, out = _launch(0, overrides(run, tiny_data, **{**FAST, "train.max_steps": 4}))
    assert code == 0, out[-4000:]
    code, out = _launch(2, overrides(run, tiny_data, **{**FAST, "train.max_steps": 8, "model.ffn_hidden": 96}))
    assert code != 0 and "exitcode  : 2" in out, out[-4000:]
    refusal = f"configuration error: cannot resume {run / 'checkpoints/step_00000004'}: model.ffn_hidden: 64 -> 96"
    assert out.count(refusal) == 1, out[-4000:]


def test_the_first_rank_to_report_an_error_says_it_and_every_other_error_is_said_too(tmp_path, monkeypatch):
    """`dist.first_to_say` over the process group's store (one rank here: a second report is what a second rank
    would make); without any store every report is said."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert dist.first_to_say("data error: a") and dist.first_to_say("data error: a"), "no store: say everything"
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert dist.first_to_say("data error: a")
        assert not dist.first_to_say("data error: a"), "the same error again: another rank said it"
        assert dist.first_to_say("data error: b"), "a different error is said"
    finally:
        dist.destroy()

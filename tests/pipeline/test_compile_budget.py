"""The compile budget: Dynamo's compiles are attributed to the step that made them, the first step's time is
logged apart from the steady state, and a recompile after the first step is a warning naming the guard."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeline.train import dist
from pipeline.train.callbacks import CompileBudget
from pipeline.train.compiles import CompileLog
from pipeline.train.config import load_config
from pipeline.train.trainer import Trainer


@pytest.fixture
def double():
    """A compiled function with fresh Dynamo state: a first call compiles, a new dtype recompiles."""
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def double_it(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    yield double_it
    torch._dynamo.reset()


def test_the_log_hands_out_each_compile_once_with_its_guard(double):
    compiles = CompileLog()
    assert compiles.take() == []
    double(torch.ones(3))
    first = compiles.take()
    assert [c.reason for c in first] == [None] and first[0].function.startswith("double_it (")
    double(torch.ones(3))
    assert compiles.take() == []  # the graph is reused
    double(torch.ones(3, dtype=torch.float64))
    (again,) = compiles.take()
    assert "dtype mismatch" in again.reason and "recompiled because" in again.describe()


def test_first_step_apart_from_the_steady_state_and_a_later_recompile_named(double, caplog):
    budget, trainer = CompileBudget(), SimpleNamespace()
    seen: dict[int, dict[str, Any]] = {}

    def step(n: int, seconds: float, dtype: torch.dtype) -> None:
        budget.pre_step(trainer, n)
        double(torch.ones(3, dtype=dtype))
        seen[n] = {"step_time_s": seconds}
        budget.post_step(trainer, n, seen[n])

    with caplog.at_level(logging.INFO, logger="pipeline.train.callbacks.compile_budget"):
        step(1, 5.0, torch.float32)  # compiles
        step(2, 0.2, torch.float32)
        double(torch.ones(3, dtype=torch.int64))  # between steps (an evaluation): no step's compile
        step(3, 0.4, torch.float64)  # recompiles
        step(4, 0.3, torch.float32)
        budget.post_train(trainer)
    assert seen[1] == {"step_time_s": 5.0, "compiles": 1, "first_step_time_s": 5.0}
    assert [seen[n]["compiles"] for n in (2, 3, 4)] == [0, 1, 0]
    assert [seen[n]["steady_step_time_s"] for n in (2, 3, 4)] == [0.2, statistics.median([0.2, 0.4]), 0.3]
    assert all("first_step_time_s" not in seen[n] for n in (2, 3, 4))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("step 3 compiled again") and "double_it" in warnings[0]
    # Dynamo names the guard of its latest graph (int64, compiled between steps) that float64 failed.
    assert "dtype mismatch. expected Long, actual Double" in warnings[0]
    assert any("first step 5.0 s (compile included), steady state 0.3000 s" in r.getMessage() for r in caplog.records)


def test_the_trainer_logs_the_first_step_apart(tmp_path: Path, tiny_data, overrides, metrics, monkeypatch):
    monkeypatch.delenv("PIPE_FAULT", raising=False)
    cfg = load_config(
        None, overrides(tmp_path / "run", tiny_data, **{"checkpoint.export": False, "train.max_steps": 3})
    )
    trainer = Trainer(cfg, dist.init_distributed("none"))
    assert trainer.train() == 0
    steps = metrics(tmp_path / "run")
    assert steps[1]["first_step_time_s"] == steps[1]["step_time_s"]
    assert steps[3]["steady_step_time_s"] == statistics.median([steps[2]["step_time_s"], steps[3]["step_time_s"]])
    assert [steps[n]["compiles"] for n in (1, 2, 3)] == [0, 0, 0]  # the CPU reference model compiles nothing

"""Two timeout budgets (issue 62, finding 3): start-up (``PIPE_STARTUP_TIMEOUT_S``, 600 s: the rendezvous, the first
step, the work between steps) and steady state (``PIPE_STEP_TIMEOUT_S``, 300 s: each later step), both defaulting
to ``PIPE_COLLECTIVE_TIMEOUT_S`` when that is set. A rank that stops answering once steps flow ends the job after
the step budget (it used to take 600 s + 31 s), with a message naming the step, the silent rank and the last
committed checkpoint; a slow first step is held to the start-up budget, not the step budget."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from torchrun_jobs import finish_job, kill_job, rank_pid, run_job, start_job, torchrun_cmd

from pipeline.train import dist
from pipeline.train.callbacks import Callback
from pipeline.train.config import load_config
from pipeline.train.trainer import Trainer, main

BUDGET_VARS = (dist.STARTUP_ENV, dist.STEP_ENV, dist.TIMEOUT_ENV)
FAST = {"train.eval_every": 0, "checkpoint.every": 4, "checkpoint.export": False, "train.max_steps": 12}
TORCHRUN_GRACE_S = 30
"""torchrun SIGTERMs the ranks left when one fails and SIGKILLs them 30 s later: a stopped rank takes that long."""


@pytest.fixture
def no_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BUDGET_VARS:
        monkeypatch.delenv(name, raising=False)


# -- the budgets --------------------------------------------------------------------------------------------------


def test_the_budgets_default_to_600_s_for_start_up_and_300_s_for_a_step(no_budgets):
    assert dist.startup_budget() == dist.Budget(600, "PIPE_STARTUP_TIMEOUT_S")
    assert dist.step_budget() == dist.Budget(300, "PIPE_STEP_TIMEOUT_S")
    assert dist.collective_timeout_s() == 600, "the collectives between steps keep the start-up budget"


def test_pipe_collective_timeout_s_is_the_default_of_both(no_budgets, monkeypatch):
    monkeypatch.setenv("PIPE_COLLECTIVE_TIMEOUT_S", "15")
    assert dist.startup_budget() == dist.step_budget() == dist.Budget(15, "PIPE_COLLECTIVE_TIMEOUT_S")
    monkeypatch.setenv("PIPE_STEP_TIMEOUT_S", "40")
    assert dist.step_budget() == dist.Budget(40, "PIPE_STEP_TIMEOUT_S")
    assert dist.startup_budget() == dist.Budget(15, "PIPE_COLLECTIVE_TIMEOUT_S")


@pytest.mark.parametrize("name", BUDGET_VARS)
@pytest.mark.parametrize("raw", ["0", "-5", "5m", "", "inf", "nan", "1e20"])
def test_a_budget_that_is_not_a_positive_number_is_one_line(no_budgets, monkeypatch, name, raw):
    for other in BUDGET_VARS:
        monkeypatch.setenv(other, "30")  # a bad legacy value is refused even when both budgets are set
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError) as refused:
        dist.check_launch()
    assert str(refused.value) == f"{name}={raw!r} must be a positive number of seconds (at most 1e+09)"


def test_the_trainer_refuses_a_bad_budget_before_any_work(no_budgets, monkeypatch, tmp_path, tiny_data, overrides):
    monkeypatch.setenv("PIPE_STEP_TIMEOUT_S", "5m")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    try:
        code = main(None, overrides(tmp_path / "run", tiny_data))
    finally:
        logging.getLogger().removeHandler(handler)
    assert code == 2
    assert [r.getMessage() for r in records] == [
        "PIPE_STEP_TIMEOUT_S='5m' must be a positive number of seconds (at most 1e+09)"
    ]
    assert not (tmp_path / "run").exists(), "nothing was written"


class BudgetSeen(Callback):
    """The budget in force inside each step (after the watchdog's ``pre_step``) and after it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, dist.Budget]] = []

    def pre_step(self, trainer: Trainer, step: int) -> None:
        self.seen.append(("step", step, dist.budget_in_force()))

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self.seen.append(("after", step, dist.budget_in_force()))


def test_the_first_step_gets_the_startup_budget_and_later_steps_the_step_budget(
    no_budgets, monkeypatch, tmp_path, tiny_data, overrides
):
    monkeypatch.setenv("PIPE_STARTUP_TIMEOUT_S", "500")
    monkeypatch.setenv("PIPE_STEP_TIMEOUT_S", "50")
    armed: list[tuple[str, dist.Budget | None]] = []
    real_arm = dist.Watchdog.arm

    def arm(self: dist.Watchdog, what: str, budget: dist.Budget | None = None) -> None:
        armed.append((what, budget))
        real_arm(self, what, budget)

    monkeypatch.setattr(dist.Watchdog, "arm", arm)
    seen = BudgetSeen()
    cfg = load_config(None, overrides(tmp_path / "run", tiny_data, **{**FAST, "train.max_steps": 3}))
    assert Trainer(cfg, dist.init_distributed("none"), [seen]).train() == 0
    startup, step = dist.Budget(500, "PIPE_STARTUP_TIMEOUT_S"), dist.Budget(50, "PIPE_STEP_TIMEOUT_S")
    assert armed == [("step 1", startup), ("step 2", step), ("step 3", step)]
    assert seen.seen == [
        ("step", 1, startup),
        ("after", 1, startup),
        ("step", 2, step),
        ("after", 2, startup),  # evaluation and saves between steps keep the long budget
        ("step", 3, step),
        ("after", 3, startup),
    ]


# -- two ranks under torchrun -------------------------------------------------------------------------------------


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in BUDGET_VARS and k != "PIPE_FAULT"}
    return {**env, "OMP_NUM_THREADS": "1", **settings}


def _committed(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*") if (p / "COMMITTED").is_file())


def _last_step(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return max((json.loads(line).get("step", 0) for line in lines if line.endswith("}")), default=0)


@pytest.mark.dist
def test_a_slow_first_step_gets_the_startup_budget_and_a_hang_later_ends_after_the_step_budget(
    tmp_path, tiny_data, overrides
):
    """Rank 1 sleeps 6 s in step 1 (longer than the 3 s step budget, well within the 30 s start-up budget: the run
    goes on), then for good in step 5: rank 0 gives up after 3 s naming the step, the silent rank and the step-4
    checkpoint, and rank 1's watchdog ends it at 1.5x 3 s."""
    run = tmp_path / "run"
    fault = "hang:step=1:rank=1:secs=6,hang:step=5:rank=1:secs=600"
    env = _env(PIPE_STARTUP_TIMEOUT_S="30", PIPE_STEP_TIMEOUT_S="3", PIPE_FAULT=fault)
    code, out, seconds = run_job(torchrun_cmd(2, overrides(run, tiny_data, **FAST)), env, timeout=180)
    assert code != 0, out[-4000:]
    assert re.search(
        r"rank 0: step 5, during .* failed: a peer rank died or did not answer within 3 s \(PIPE_STEP_TIMEOUT_S\); "
        r"no answer from rank\(s\) \[1\]",
        out,
    ), out[-4000:]
    assert f"the last committed checkpoint is {run / 'checkpoints/step_00000004'}" in out, out[-4000:]
    assert "rank 1: step 5 did not finish within 4 s (1.5x its 3 s budget, PIPE_STEP_TIMEOUT_S)" in out
    assert _committed(run) == ["step_00000004"] and _last_step(run) == 4, "step 1's 6 s did not end the run"
    assert seconds < 90, f"took {seconds:.0f} s"


@pytest.mark.dist
def test_a_hang_in_the_first_step_is_bounded_by_the_startup_budget(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    env = _env(PIPE_STARTUP_TIMEOUT_S="8", PIPE_STEP_TIMEOUT_S="2", PIPE_FAULT="hang:step=1:rank=1:secs=600")
    code, out, seconds = run_job(torchrun_cmd(2, overrides(run, tiny_data, **FAST)), env, timeout=180)
    assert code != 0, out[-4000:]
    assert re.search(
        r"rank 0: step 1, during .* did not answer within 8 s \(PIPE_STARTUP_TIMEOUT_S\); no answer from rank\(s\) "
        r"\[1\]",
        out,
    ), out[-4000:]
    assert f"no checkpoint was committed in {run / 'checkpoints'}: a relaunch starts from step 0" in out
    assert "rank 1: step 1 did not finish within 12 s (1.5x its 8 s budget, PIPE_STARTUP_TIMEOUT_S)" in out
    assert seconds < 90, f"took {seconds:.0f} s"


@pytest.mark.dist
def test_a_stopped_rank_ends_the_job_within_the_step_budget(tmp_path, tiny_data, overrides):
    """The issue's case: one of two ranks stopped (SIGSTOP) once steps flow. Rank 1 is stopped inside step 6 (a
    hang planned there keeps it in that step until the signal lands); rank 0 gives up after the 4 s step budget,
    torchrun then kills the stopped rank after its own grace. It used to end after 600 s + 31 s."""
    run = tmp_path / "run"
    env = _env(PIPE_STARTUP_TIMEOUT_S="60", PIPE_STEP_TIMEOUT_S="4", PIPE_FAULT="hang:step=6:rank=1:secs=600")
    proc = start_job(torchrun_cmd(2, overrides(run, tiny_data, **FAST)), env)
    try:
        deadline = time.monotonic() + 120
        while _last_step(run) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 5"
            time.sleep(0.1)
        time.sleep(0.5)  # rank 1 is past step 5's last collective, asleep in step 6
        victim = rank_pid(proc.pid, 1)
        assert victim is not None, "rank 1's process"
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        out = finish_job(proc, timeout=4 + TORCHRUN_GRACE_S + 60)
        ended_after = time.monotonic() - stopped
    finally:
        kill_job(proc)  # also when the job never got that far
    assert proc.returncode != 0, out[-4000:]
    assert re.search(
        r"rank 0: step 6, during .* failed: a peer rank died or did not answer within 4 s \(PIPE_STEP_TIMEOUT_S\); "
        r"no answer from rank\(s\) \[1\]",
        out,
    ), out[-4000:]
    assert f"the last committed checkpoint is {run / 'checkpoints/step_00000004'}" in out, out[-4000:]
    assert ended_after < 4 + TORCHRUN_GRACE_S + 15, f"the job ended {ended_after:.0f} s after rank 1 stopped"

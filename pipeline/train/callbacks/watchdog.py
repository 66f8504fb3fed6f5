"""The hang watchdog around every training step (``dist.Watchdog``): a stuck rank ends in bounded time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.train import dist
from pipeline.train.callbacks.base import Callback

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer


class HangWatchdog(Callback):
    """Arms the watchdog before each step and disarms it after; the step region is the data read, forward/backward
    with the gradient reduction, the optimizer step and the loss all-reduce. Registered first, so it is armed
    before any other ``pre_step`` hook runs and disarmed before the ``post_step`` work (logging, evaluation, the
    extrapolation monitor, saves, whose collectives have their own timeout): time spent there is never a hang.

    It also sets the budget every collective waits for (``dist.apply_budget``): the first step of this process
    (compiles, the first touch of a resumed state) gets the start-up budget, each later step the step budget, and
    the work between steps the start-up budget again, so a healthy slow save or evaluation is never cut short by
    the step budget."""

    def __init__(self) -> None:
        self.watchdog: dist.Watchdog | None = None
        self.startup, self.step = dist.startup_budget(), dist.step_budget()
        self.steps_done = 0

    def pre_train(self, trainer: Trainer) -> None:
        self.watchdog = dist.Watchdog(self.startup.seconds, trainer.info.rank)
        dist.apply_budget(self.startup)  # the engines' own groups were made with torch's default timeouts

    def pre_step(self, trainer: Trainer, step: int) -> None:
        assert self.watchdog is not None, "pre_train starts the watchdog"
        budget = self.step if self.steps_done else self.startup
        dist.apply_budget(budget)
        self.watchdog.arm(f"step {step}", budget)

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        assert self.watchdog is not None, "pre_train starts the watchdog"
        self.watchdog.disarm()
        dist.apply_budget(self.startup)
        self.steps_done += 1

    def post_train(self, trainer: Trainer) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

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
    extrapolation monitor, saves, whose collectives have their own timeout): time spent there is never a hang."""

    def __init__(self) -> None:
        self.watchdog: dist.Watchdog | None = None

    def pre_train(self, trainer: Trainer) -> None:
        self.watchdog = dist.Watchdog(dist.collective_timeout_s(), trainer.info.rank)

    def pre_step(self, trainer: Trainer, step: int) -> None:
        assert self.watchdog is not None, "pre_train starts the watchdog"
        self.watchdog.arm(f"step {step}")

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        assert self.watchdog is not None, "pre_train starts the watchdog"
        self.watchdog.disarm()

    def post_train(self, trainer: Trainer) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

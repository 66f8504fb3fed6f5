"""When to save: every ``checkpoint.every`` steps, at ``train.max_steps``, and when the trainer is stopping."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.train.callbacks.base import Callback

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer


class CheckpointCadence(Callback):
    """Saves the step just finished when it is a multiple of ``checkpoint.every`` (0: never periodically), the
    last step, or a step after which a stop was requested (so a requeue resumes exactly there). Registered last:
    the step's metrics, evaluation and stop decision come first. How many checkpoints stay is the
    ``CheckpointManager``'s ``keep_last``."""

    def __init__(self, every: int, max_steps: int) -> None:
        self.every, self.max_steps = every, max_steps

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        periodic = self.every and step % self.every == 0
        if periodic or step == self.max_steps or trainer.exit_code is not None:
            trainer.save()

"""Retrieval telemetry in the step metrics: what the model's retrieval did in this rank's last micro-batch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.train.callbacks.base import Callback

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer


class RetrievalTelemetry(Callback):
    """Adds the model's ``retrieval_stats`` (per retrieval group: weight entropy, mean retrieved-chunk distance) to
    the step's metrics; registered before the metrics logger. A model without retrieval adds nothing."""

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        stats = getattr(trainer.engine.module, "retrieval_stats", {})
        metrics.update({name: float(value) for name, value in stats.items()})

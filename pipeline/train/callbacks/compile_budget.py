"""The compile budget: the first step's time (``torch.compile`` included) apart from the steady-state step time,
and a warning naming the cause when a step after the first compiles again."""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING, Any

from pipeline.train.callbacks.base import Callback
from pipeline.train.compiles import CompileLog

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer

log = logging.getLogger(__name__)


class CompileBudget(Callback):
    """Adds to the step's metrics ``compiles`` (Dynamo compiles inside the step), ``first_step_time_s`` on the
    first step of this process (it pays for compiling every graph) and ``steady_step_time_s`` on later steps (the
    median step time since the first). A compile inside a later step is a warning naming the function and the
    guard that failed: the graphs of the first step should serve every later one, and a guard that fails each
    step (a Python value captured in a compiled function, a changing shape) costs a compile per step and, past
    Dynamo's recompile limit, the uncompiled path. Compiles between steps (validation, evaluation) are not
    counted. Registered before the metrics logger."""

    def __init__(self) -> None:
        self.compiles = CompileLog()
        self.first_step: int | None = None
        self.first_step_time_s = 0.0
        self.later_times: list[float] = []

    def pre_step(self, trainer: Trainer, step: int) -> None:
        self.compiles.take()  # what compiled before this step belongs to no step
        if self.first_step is None:
            self.first_step = step

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        compiles = self.compiles.take()
        metrics["compiles"] = len(compiles)
        if step == self.first_step:
            self.first_step_time_s = metrics["step_time_s"]
            metrics["first_step_time_s"] = self.first_step_time_s
            log.info(
                "step %d, the first of this process: %.1f s, %d Dynamo compile(s), %.1f s of it compiling",
                step,
                self.first_step_time_s,
                len(compiles),
                sum(c.seconds for c in compiles),
            )
            return
        self.later_times.append(metrics["step_time_s"])
        metrics["steady_step_time_s"] = statistics.median(self.later_times)
        for c in compiles:
            log.warning(
                "step %d compiled again after the first step (%s); every later step should reuse the first step's "
                "graphs, so a recompile per step means a guard that changes every step (TORCH_LOGS=recompiles "
                "shows all of them; docs/training.md#compile-budget)",
                step,
                c.describe(),
            )

    def post_train(self, trainer: Trainer) -> None:
        if self.later_times:
            log.info(
                "compile budget: first step %.1f s (compile included), steady state %.4f s per step (median of %d)",
                self.first_step_time_s,
                statistics.median(self.later_times),
                len(self.later_times),
            )

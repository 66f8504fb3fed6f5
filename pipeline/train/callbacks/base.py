"""The trainer's extension points: a `Callback` with no-op hooks, and `CallbackList`, which calls them in order.

The trainer calls the hooks at fixed points of a run; everything around the step (metrics, evaluation, checkpoint
cadence, signal handling, the hang watchdog, telemetry, fault injection) is a callback. Hooks of one point run in
list order, so a callback that feeds another (telemetry into the metrics it logs, a stop decision into the
checkpoint cadence) comes before it. Steps are 1-based: ``pre_step`` gets the step about to run, every later hook
the step it belongs to.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer


class Callback:
    """One concern of a run; override the hooks it needs."""

    def pre_train(self, trainer: Trainer) -> None:
        """After the resume, before the first step (``trainer.step`` is the step the run starts from)."""

    def pre_step(self, trainer: Trainer, step: int) -> None:
        """Before step ``step``, inside the region the watchdog guards and the step's error handling covers."""

    def pre_optim_step(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        """After forward/backward and gradient clipping, before the collective finiteness check and the optimizer
        step. ``loss`` is this rank's mean loss of the step; the check sees it as the callbacks leave it."""

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        """After step ``step`` finished on every rank; ``metrics`` may gain entries for the callbacks after this."""

    def on_eval(self, trainer: Trainer, step: int, val_loss: float, metrics: dict[str, float]) -> None:
        """A validation pass after step ``step`` gave ``val_loss`` and the other ``metrics`` it measured (GCA models:
        ``retrieval/far_recall`` and its companions); the same values on every rank."""

    def on_save_point(self, trainer: Trainer, step: int, point: str) -> None:
        """Inside the save of ``step``, at ``point`` (one of ``checkpoint.SAVE_POINTS``, in that order)."""

    def post_checkpoint(self, trainer: Trainer, step: int, path: Path) -> None:
        """The checkpoint of ``step`` is committed at ``path``."""

    def post_train(self, trainer: Trainer) -> None:
        """The run ended, normally or by an exception (also after a ``pre_train`` that did not finish)."""


@contextmanager
def _naming(callback: Callback, hook: str) -> Iterator[None]:
    """Re-raise whatever the hook raises, unchanged but for a note naming the callback (shown in the traceback)."""
    try:
        yield
    except BaseException as err:
        err.add_note(f"raised in the trainer callback {type(callback).__name__}.{hook}")
        raise


class CallbackList(Callback):
    """Calls each hook on every callback, in list order; an exception stops the dispatch and propagates with a
    note naming the callback, except in ``post_train``, which runs every callback before it re-raises the first."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def pre_train(self, trainer: Trainer) -> None:
        for cb in self.callbacks:
            with _naming(cb, "pre_train"):
                cb.pre_train(trainer)

    def pre_step(self, trainer: Trainer, step: int) -> None:
        for cb in self.callbacks:
            with _naming(cb, "pre_step"):
                cb.pre_step(trainer, step)

    def pre_optim_step(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        for cb in self.callbacks:
            with _naming(cb, "pre_optim_step"):
                cb.pre_optim_step(trainer, step, loss)

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        for cb in self.callbacks:
            with _naming(cb, "post_step"):
                cb.post_step(trainer, step, metrics)

    def on_eval(self, trainer: Trainer, step: int, val_loss: float, metrics: dict[str, float]) -> None:
        for cb in self.callbacks:
            with _naming(cb, "on_eval"):
                cb.on_eval(trainer, step, val_loss, metrics)

    def on_save_point(self, trainer: Trainer, step: int, point: str) -> None:
        for cb in self.callbacks:
            with _naming(cb, "on_save_point"):
                cb.on_save_point(trainer, step, point)

    def post_checkpoint(self, trainer: Trainer, step: int, path: Path) -> None:
        for cb in self.callbacks:
            with _naming(cb, "post_checkpoint"):
                cb.post_checkpoint(trainer, step, path)

    def post_train(self, trainer: Trainer) -> None:
        # Cleanup (signal handlers, the watchdog thread, open files) must run for every callback.
        first: BaseException | None = None
        for cb in self.callbacks:
            try:
                with _naming(cb, "post_train"):
                    cb.post_train(trainer)
            except BaseException as err:
                first = first or err
        if first is not None:
            raise first

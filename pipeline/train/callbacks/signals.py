"""Stop on SIGTERM, SIGUSR1 or a first Ctrl-C: save at the next step boundary, on every rank, then exit."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from pipeline.train import dist
from pipeline.train.callbacks.base import Callback

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130
"""Exit code after a Ctrl-C (SIGINT): 128 + SIGINT, as a shell reports it; never the requeue code."""
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class SignalStop(Callback):
    """While training, SIGTERM/SIGUSR1/SIGINT only set a flag. After every step the ranks agree (one all-reduce)
    whether any rank got one; if so the trainer is asked to stop, the checkpoint cadence saves this step, and the
    run exits with ``train.requeue_exit_code``, or `EXIT_INTERRUPTED` if any rank got a Ctrl-C (its user asked to
    stop, not the scheduler). A repeated SIGTERM/SIGUSR1 (SLURM and launchers often send two) changes nothing; a
    Ctrl-C while a stop is pending raises ``KeyboardInterrupt`` at once, without saving."""

    def __init__(self) -> None:
        self._received: int | None = None
        self._exit_code: int | None = None
        self._step = 0
        self._previous: dict[int, Any] = {}

    def pre_train(self, trainer: Trainer) -> None:
        self._step = trainer.step
        self._previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self._step = step
        mine = 0.0 if self._received is None else 2.0 if self._received == signal.SIGINT else 1.0
        flag = torch.tensor([mine], device=trainer.info.device)
        worst = dist.guarded_collective(
            trainer.info.rank, f"step {step}: stop-flag all-reduce", lambda: dist.all_reduce_max(flag).item()
        )
        if worst:
            self._exit_code = trainer.cfg.train.requeue_exit_code if worst == 1.0 else EXIT_INTERRUPTED
            trainer.request_stop(self._exit_code)

    def post_checkpoint(self, trainer: Trainer, step: int, path: Path) -> None:
        if self._exit_code is not None:
            log.warning(
                "stop signal received: saved step %d, exiting with code %d%s",
                step,
                self._exit_code,
                "" if self._exit_code == EXIT_INTERRUPTED else " for a requeue",
            )

    def post_train(self, trainer: Trainer) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._received is not None:
            raise KeyboardInterrupt
        if self._received is None:
            self._received = signum
            if signum == signal.SIGINT:
                log.warning(
                    "Ctrl-C: saving a checkpoint after step %d, then exiting with code %d; press Ctrl-C "
                    "again to stop at once without saving",
                    self._step + 1,
                    EXIT_INTERRUPTED,
                )

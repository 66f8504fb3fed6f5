"""Fires the faults of ``PIPE_FAULT`` (``pipeline.train.faults``) at their step, rank and point: the reliability tests.

The trainer registers `FaultInjector` only when ``PIPE_FAULT`` plans a fault (`from_env`); a normal run has no
trace of it in its callbacks, its steps or its saves.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

import torch

from pipeline.train import faults
from pipeline.train.callbacks.base import Callback

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer


def from_env(rank: int) -> FaultInjector | None:
    """The injector for the faults ``PIPE_FAULT`` plans on any rank, or None when it is unset.

    Raises:
        ValueError: a malformed ``PIPE_FAULT`` (so a typo never silently disables a test).
    """
    plan = faults.from_env()
    return None if plan is None else FaultInjector(plan, rank)


class _InfGradient(torch.autograd.Function):
    """Identity in the forward pass, +inf gradient in the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


class FaultInjector(Callback):
    """The faults of ``plan`` that belong to ``rank``, each fired from the hook at its point of the run:

    - ``hang``, ``oom``: ``pre_step`` (inside the watchdog's region and the step's out-of-memory handling);
    - ``nan_loss``: ``pre_optim_step``, the loss becomes NaN before the collective finiteness check;
    - ``inf_grad``: a forward hook on the model, installed in ``pre_train``, gives the loss of that step an
      infinite gradient while its value stays finite (so it reaches every engine's gradients, DeepSpeed's
      partitioned ones included);
    - ``kill``, ``sigusr1``, ``sigint``: ``post_step``, after the step's metrics are logged;
    - ``exit_during_save``, ``signal_during_save``: ``on_save_point``.
    """

    def __init__(self, plan: faults.FaultPlan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self._inf_grad_hook: torch.utils.hooks.RemovableHandle | None = None

    def pre_train(self, trainer: Trainer) -> None:
        if self.plan.has("inf_grad"):
            self._inf_grad_hook = trainer.engine.module.register_forward_hook(self._inf_grad(trainer))

    def _inf_grad(self, trainer: Trainer) -> Any:
        def hook(_module: torch.nn.Module, _inputs: object, output: Any) -> object:
            loss = getattr(output, "loss", None)
            step = trainer.step + 1  # the step in progress
            if loss is not None and torch.is_grad_enabled() and self.plan.hits("inf_grad", step, self.rank):
                return output._replace(loss=_InfGradient.apply(loss))
            return output

        return hook

    def pre_step(self, trainer: Trainer, step: int) -> None:
        hang = self.plan.find("hang", step, self.rank)
        if hang is not None:
            time.sleep(float(hang.options["secs"]))
        if self.plan.hits("oom", step, self.rank):
            raise torch.OutOfMemoryError(
                f"injected out-of-memory error (PIPE_FAULT) at step {step} on rank {self.rank}"
            )

    def pre_optim_step(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        if self.plan.hits("nan_loss", step, self.rank):
            loss.mul_(float("nan"))

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        for kind, signum in (("kill", signal.SIGKILL), ("sigusr1", signal.SIGUSR1), ("sigint", signal.SIGINT)):
            if self.plan.hits(kind, step, self.rank):
                os.kill(os.getpid(), signum)

    def on_save_point(self, trainer: Trainer, step: int, point: str) -> None:
        sig = self.plan.find("signal_during_save", step, self.rank)
        if sig is not None and sig.options["at"] == point:
            os.kill(os.getpid(), faults.SIGNALS[sig.options["sig"]])
        crash = self.plan.find("exit_during_save", step, self.rank)
        if crash is not None and crash.options["at"] == point:
            os._exit(1)  # no cleanup, no finally blocks: a torn save, as after a node failure

    def post_train(self, trainer: Trainer) -> None:
        if self._inf_grad_hook is not None:
            self._inf_grad_hook.remove()
            self._inf_grad_hook = None

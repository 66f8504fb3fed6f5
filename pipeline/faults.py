"""Fault injection for the reliability tests (``tests/reliability``, docs/reliability.md), read from ``PIPE_FAULT``.

``PIPE_FAULT`` holds one fault or several separated by commas; each is ``<kind>:step=N[:rank=R][:key=value]``
(no ``rank`` = every rank). ``step`` is the 1-based optimizer step the fault belongs to:

- ``nan_loss:step=5:rank=1``: that rank's loss becomes NaN (before the collective finiteness check).
- ``inf_grad:step=5``: the loss stays finite but its gradient is +inf (reaches every engine, DeepSpeed included).
- ``oom:step=3:rank=0``: ``torch.OutOfMemoryError`` at the start of the step.
- ``hang:step=6:rank=1[:secs=3600]``: sleep at the start of the step, a stuck rank.
- ``kill:step=7:rank=1``: SIGKILL itself after finishing the step.
- ``sigusr1:step=5:rank=1``: send itself SIGUSR1 after finishing the step (a preemption warning).
- ``sigint:step=5``: send itself SIGINT after finishing the step (a Ctrl-C).
- ``exit_during_save:step=8[:at=engine]``: ``os._exit(1)`` inside the save of that step, at one of `SAVE_POINTS`.
- ``signal_during_save:step=5[:at=engine][:sig=usr1|term|int]``: send itself a signal inside that save.

Off by default: with ``PIPE_FAULT`` unset, ``from_env`` returns ``None`` and every hook is one ``is None`` test.
A malformed value is an error, so a typo never silently disables a test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SAVE_POINTS = ("engine", "rng", "export", "trainer_state", "manifest", "renamed")
"""Points inside ``CheckpointManager.save``, in order: after the engine state, the per-rank RNG files, the eval
export, ``trainer_state.json``, the integrity manifest, and after the rename to ``step_N/`` (before the marker)."""

_OPTIONS: dict[str, dict[str, str | None]] = {
    # kind -> {option: default}; every kind also takes step (required) and rank
    "nan_loss": {},
    "inf_grad": {},
    "oom": {},
    "hang": {"secs": "3600"},
    "kill": {},
    "sigusr1": {},
    "sigint": {},
    "exit_during_save": {"at": "engine"},
    "signal_during_save": {"at": "engine", "sig": "usr1"},
}
KINDS = tuple(_OPTIONS)
_OPTION_HELP = "; ".join(f"{kind}: {', '.join(opts)}" for kind, opts in _OPTIONS.items() if opts)
_SIGNALS = {"usr1": signal.SIGUSR1, "term": signal.SIGTERM, "int": signal.SIGINT}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None
    options: dict[str, str] = field(default_factory=dict)

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and self.rank in (None, rank)


@dataclass(frozen=True)
class FaultPlan:
    """The faults of this process (usually one)."""

    faults: tuple[Fault, ...]

    def find(self, kind: str, step: int, rank: int) -> Fault | None:
        return next((f for f in self.faults if f.hits(kind, step, rank)), None)

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return self.find(kind, step, rank) is not None

    def has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.faults)


def _parse_one(spec: str) -> Fault:
    usage = f"expected <{'|'.join(KINDS)}>:step=N[:rank=R][:key=value], comma-separated; options: {_OPTION_HELP}"
    kind, *fields = spec.strip().split(":")
    if kind not in _OPTIONS or any("=" not in f for f in fields):
        raise ValueError(f"PIPE_FAULT entry {spec!r}: {usage}")
    values = dict(f.split("=", 1) for f in fields)
    allowed = {"step", "rank", *_OPTIONS[kind]}
    if "step" not in values or set(values) - allowed:
        raise ValueError(f"PIPE_FAULT entry {spec!r}: {usage}")
    options = {k: v for k, v in _OPTIONS[kind].items() if v is not None}
    options.update({k: v for k, v in values.items() if k not in ("step", "rank")})
    if kind in ("exit_during_save", "signal_during_save") and options["at"] not in SAVE_POINTS:
        raise ValueError(f"PIPE_FAULT entry {spec!r}: at= must be one of {', '.join(SAVE_POINTS)}")
    if kind == "signal_during_save" and options["sig"] not in _SIGNALS:
        raise ValueError(f"PIPE_FAULT entry {spec!r}: sig= must be one of {', '.join(_SIGNALS)}")
    try:
        return Fault(kind, int(values["step"]), int(values["rank"]) if "rank" in values else None, options)
    except ValueError:
        raise ValueError(f"PIPE_FAULT entry {spec!r}: step and rank must be integers") from None


def from_env() -> FaultPlan | None:
    spec = os.environ.get("PIPE_FAULT", "")
    if not spec.strip():
        return None
    return FaultPlan(tuple(_parse_one(s) for s in spec.split(",") if s.strip()))


def before_step(plan: FaultPlan | None, step: int, rank: int) -> None:
    """Faults at the start of optimizer step ``step`` (1-based): a stuck rank, an out-of-memory error."""
    if plan is None:
        return
    hang = plan.find("hang", step, rank)
    if hang is not None:
        time.sleep(float(hang.options["secs"]))
    if plan.hits("oom", step, rank):
        raise torch.OutOfMemoryError(f"injected out-of-memory error (PIPE_FAULT) at step {step} on rank {rank}")


def after_step(plan: FaultPlan | None, step: int, rank: int) -> None:
    """Process-level faults, fired after ``step`` completed."""
    if plan is None:
        return
    if plan.hits("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if plan.hits("sigusr1", step, rank):
        os.kill(os.getpid(), signal.SIGUSR1)
    if plan.hits("sigint", step, rank):
        os.kill(os.getpid(), signal.SIGINT)


def during_save(plan: FaultPlan | None, step: int, rank: int, point: str) -> None:
    """Faults inside the save of ``step``, at ``point`` (one of `SAVE_POINTS`)."""
    if plan is None:
        return
    sig = plan.find("signal_during_save", step, rank)
    if sig is not None and sig.options["at"] == point:
        os.kill(os.getpid(), _SIGNALS[sig.options["sig"]])
    crash = plan.find("exit_during_save", step, rank)
    if crash is not None and crash.options["at"] == point:
        os._exit(1)  # no cleanup, no finally blocks: a torn save, as after a node failure


class _InfGradient(torch.autograd.Function):
    """Identity in the forward pass, +inf gradient in the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.full_like(grad, float("inf"))


def install_inf_grad(plan: FaultPlan | None, module: torch.nn.Module, rank: int, step_of: Callable[[], int]) -> None:
    """For ``inf_grad`` faults: a forward hook on ``module`` that gives the loss an infinite gradient.

    The hook is installed only when such a fault is planned. ``step_of`` is a callable returning the step in
    progress (1-based). Working on the loss means it reaches every engine's gradients, DeepSpeed's partitioned
    ones included, while the loss value itself stays finite.
    """
    if plan is None or not plan.has("inf_grad"):
        return

    def hook(_module: torch.nn.Module, _inputs: object, output: object) -> object:
        loss = getattr(output, "loss", None)
        step = step_of()
        if loss is not None and torch.is_grad_enabled() and plan.hits("inf_grad", step, rank):
            output.loss = _InfGradient.apply(loss)  # type: ignore[attr-defined]
        return output

    module.register_forward_hook(hook)

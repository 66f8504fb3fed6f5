"""The fault plan of the reliability tests (``tests/reliability``, docs/reliability.md), read from ``PIPE_FAULT``.

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

Off by default: with ``PIPE_FAULT`` unset, ``from_env`` returns ``None`` and the trainer registers no fault
injector (``pipeline.train.callbacks.fault_injection``, which fires the faults). A malformed value is an
error, so a typo never silently disables a test.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from pipeline.train.checkpoint import SAVE_POINTS

__all__ = ["KINDS", "SAVE_POINTS", "SIGNALS", "Fault", "FaultPlan", "from_env"]

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
# The signals ``signal_during_save`` can send, by their ``sig=`` name.
SIGNALS = {"usr1": signal.SIGUSR1, "term": signal.SIGTERM, "int": signal.SIGINT}


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
    if kind == "signal_during_save" and options["sig"] not in SIGNALS:
        raise ValueError(f"PIPE_FAULT entry {spec!r}: sig= must be one of {', '.join(SIGNALS)}")
    try:
        return Fault(kind, int(values["step"]), int(values["rank"]) if "rank" in values else None, options)
    except ValueError:
        raise ValueError(f"PIPE_FAULT entry {spec!r}: step and rank must be integers") from None


def from_env() -> FaultPlan | None:
    spec = os.environ.get("PIPE_FAULT", "")
    if not spec.strip():
        return None
    return FaultPlan(tuple(_parse_one(s) for s in spec.split(",") if s.strip()))

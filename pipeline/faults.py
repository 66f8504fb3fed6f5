"""Fault injection for the reliability tests, read from ``PIPE_FAULT`` (RELIABILITY.md §5.1).

``PIPE_FAULT="nan_loss:step=3"``, ``"nan_loss:step=3:rank=1"``, ``"kill:step=7:rank=1"`` (SIGKILL itself after
finishing that step) or ``"sigusr1:step=5:rank=1"``. Unset in real runs; parsing a malformed value is an error
so a typo never silently disables a test.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

KINDS = ("nan_loss", "kill", "sigusr1")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and self.rank in (None, rank)


def from_env() -> Fault | None:
    spec = os.environ.get("PIPE_FAULT", "")
    if not spec:
        return None
    kind, *fields = spec.split(":")
    values = dict(f.split("=", 1) for f in fields)
    if kind not in KINDS or "step" not in values or set(values) - {"step", "rank"}:
        raise ValueError(f"PIPE_FAULT={spec!r}: expected <{'|'.join(KINDS)}>:step=N[:rank=R]")
    return Fault(kind, int(values["step"]), int(values["rank"]) if "rank" in values else None)


def after_step(fault: Fault | None, step: int, rank: int) -> None:
    """Process-level faults, fired after ``step`` completed."""
    if fault is None:
        return
    if fault.hits("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.hits("sigusr1", step, rank):
        os.kill(os.getpid(), signal.SIGUSR1)

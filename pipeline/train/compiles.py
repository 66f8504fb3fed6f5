"""What ``torch.compile`` compiled in this process: one record per Dynamo compile, with the guard that failed.

Dynamo keeps a record of its latest compiles (``torch._dynamo.utils.get_compilation_metrics``, the source of
``TORCH_LOGS=recompiles`` and of its compile-time reports); ``CompileLog`` hands out the ones made since it last
looked, so the trainer can say which step compiled what and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch._dynamo.utils import get_compilation_metrics


@dataclass(frozen=True)
class Compile:
    """One Dynamo compile of a function (a first compile or a recompile)."""

    function: str
    """``name (file:line)`` of the compiled function."""
    reason: str | None
    """The guard that failed, as Dynamo words it (``None``: the function's first compile)."""
    seconds: float
    """Compile time of the frame (0 when Dynamo did not record one)."""

    def describe(self) -> str:
        # Dynamo gives one line per cached graph whose guards failed; one line of text for a log record.
        guards = "; ".join(line.strip() for line in (self.reason or "").splitlines() if line.strip())
        cause = "first compile" if self.reason is None else f"recompiled because {guards}"
        return f"{self.function}: {cause} ({self.seconds:.1f} s)"


class CompileLog:
    """The compiles made since the previous ``take`` (or since the log was made)."""

    def __init__(self) -> None:
        self._last = _latest()

    def take(self) -> list[Compile]:
        records = get_compilation_metrics()
        # Dynamo keeps only its latest records; when the last one seen is gone, every kept record is new.
        start = next((i + 1 for i, r in enumerate(records) if r is self._last), 0) if self._last is not None else 0
        self._last = records[-1] if records else self._last
        return [
            Compile(
                function=f"{r.co_name} ({r.co_filename}:{r.co_firstlineno})",
                reason=r.recompile_reason,
                seconds=r.entire_frame_compile_time_s or 0.0,
            )
            for r in records[start:]
        ]


def _latest() -> object | None:
    records = get_compilation_metrics()
    return records[-1] if records else None

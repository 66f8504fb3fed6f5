"""Everything around the training step, as callbacks of ``pipeline.train.trainer.Trainer`` (hooks in `base`)."""

from pipeline.train.callbacks import fault_injection
from pipeline.train.callbacks.base import Callback, CallbackList
from pipeline.train.callbacks.checkpointing import CheckpointCadence
from pipeline.train.callbacks.compile_budget import CompileBudget
from pipeline.train.callbacks.extrapolation import ExtrapolationMonitor
from pipeline.train.callbacks.metrics import MetricsLogging
from pipeline.train.callbacks.signals import EXIT_INTERRUPTED, SignalStop
from pipeline.train.callbacks.telemetry import RetrievalTelemetry
from pipeline.train.callbacks.validation import EvalError, PeriodicEval
from pipeline.train.callbacks.watchdog import HangWatchdog

__all__ = [
    "EXIT_INTERRUPTED",
    "Callback",
    "CallbackList",
    "CheckpointCadence",
    "CompileBudget",
    "EvalError",
    "ExtrapolationMonitor",
    "HangWatchdog",
    "MetricsLogging",
    "PeriodicEval",
    "RetrievalTelemetry",
    "SignalStop",
    "fault_injection",
]

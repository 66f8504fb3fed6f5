"""Everything around the training step, as callbacks of ``pipeline.trainer.Trainer`` (hooks in `base`)."""

from pipeline.callbacks import fault_injection
from pipeline.callbacks.base import Callback, CallbackList
from pipeline.callbacks.checkpointing import CheckpointCadence
from pipeline.callbacks.evaluation import EvalError, PeriodicEval
from pipeline.callbacks.extrapolation import ExtrapolationMonitor
from pipeline.callbacks.metrics import MetricsLogging
from pipeline.callbacks.signals import EXIT_INTERRUPTED, SignalStop
from pipeline.callbacks.telemetry import RetrievalTelemetry
from pipeline.callbacks.watchdog import HangWatchdog

__all__ = [
    "EXIT_INTERRUPTED",
    "Callback",
    "CallbackList",
    "CheckpointCadence",
    "EvalError",
    "ExtrapolationMonitor",
    "HangWatchdog",
    "MetricsLogging",
    "PeriodicEval",
    "RetrievalTelemetry",
    "SignalStop",
    "fault_injection",
]

"""The run's record on rank 0: ``config.yaml``, the run header, per-step metrics and evaluation results."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from data_prep.redaction import redact
from data_prep.safe_write import write_text
from pipeline.evaluation.far_recall import shown_with_counts
from pipeline.train.callbacks.base import Callback
from pipeline.train.config import to_plain, to_yaml
from pipeline.train.metrics import MetricsLogger, log_run_header, processor, write_failed
from pipeline.train.run_files import CONFIG_FILE

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer

log = logging.getLogger(__name__)


class MetricsLogging(Callback):
    """On rank 0: writes ``<run_dir>/config.yaml`` (the resolved config of the latest start, re-runnable with
    ``--config``), logs the run header, and sends every step's metrics and every validation loss to
    ``MetricsLogger`` (metrics.jsonl, wandb, progress bar; a console line every ``logging.every`` steps and at the
    last one) with the validation pass's other metrics (far recall). Other ranks log nothing."""

    def __init__(self) -> None:
        self.metrics: MetricsLogger | None = None

    def pre_train(self, trainer: Trainer) -> None:
        if not trainer.info.is_main:
            return
        cfg = trainer.cfg
        _write_resolved_config(trainer)
        header = log_run_header(to_yaml(cfg), _derived(trainer))
        self.metrics = MetricsLogger(trainer.run_dir, cfg, to_plain(cfg), header, trainer.step, trainer.resumed)

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.metrics is not None:
            console = step % trainer.cfg.logging.every == 0 or step == trainer.cfg.train.max_steps
            self.metrics.step(step, metrics, console)

    def on_eval(self, trainer: Trainer, step: int, val_loss: float, metrics: dict[str, float]) -> None:
        shown = f" {shown_with_counts(metrics)}" if metrics else ""
        log.info("step %d | val_loss=%.4f%s", step, val_loss, shown)
        if self.metrics is not None:
            self.metrics.event({"event": "eval", "step": step, "val_loss": val_loss, **metrics})

    def post_train(self, trainer: Trainer) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def _write_resolved_config(trainer: Trainer) -> None:
    trainer.run_dir.mkdir(parents=True, exist_ok=True)
    path = trainer.run_dir / CONFIG_FILE
    try:
        write_text(path, redact(to_yaml(trainer.cfg)))
    except OSError as err:  # a full disk or a quota at the start: the metrics' one line, naming config.yaml
        raise write_failed(err, path) from None


def _derived(trainer: Trainer) -> dict[str, Any]:
    """The values the config implies for this launch (world size, batch split, model size, FLOPs, precision)."""
    cfg = trainer.cfg
    return {
        "world_size": trainer.info.world_size,
        "grad_accum": trainer.accum,
        "tokens_per_step": cfg.tokens_per_step,
        "total_tokens": cfg.tokens_per_step * cfg.train.max_steps,
        "params": trainer.n_params,
        "flops_per_token": trainer.flops_per_token,
        "bf16": trainer.bf16,
        "device": str(trainer.info.device),
        "processor": processor(),  # every CPU figure of the run (step time, tokens/s) was measured on it
    }

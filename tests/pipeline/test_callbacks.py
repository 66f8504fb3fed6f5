"""The trainer's callbacks: hooks run at fixed points in list order with the right step, a failing callback is
named, cleanup reaches every callback, and the fault injector exists only when a fault is planned."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.train import dist
from pipeline.train.callbacks import Callback, CallbackList, CheckpointCadence, HangWatchdog, PeriodicEval, SignalStop
from pipeline.train.callbacks.fault_injection import FaultInjector
from pipeline.train.checkpoint import SAVE_POINTS
from pipeline.train.config import load_config
from pipeline.train.trainer import Trainer


class Recorder(Callback):
    """Records every hook call as ``(hook, step)``, with what the trainer showed it at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.metrics: dict[int, dict[str, Any]] = {}
        self.trainer_step_at_post: dict[int, int] = {}

    def pre_train(self, trainer: Trainer) -> None:
        self.calls.append(("pre_train", trainer.step))

    def pre_step(self, trainer: Trainer, step: int) -> None:
        self.calls.append(("pre_step", step))

    def pre_optim_step(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        self.calls.append(("pre_optim_step", step))

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("post_step", step))
        self.metrics[step] = dict(metrics)
        self.trainer_step_at_post[step] = trainer.step

    def on_eval(self, trainer: Trainer, step: int, val_loss: float, metrics: dict[str, float]) -> None:
        self.calls.append(("on_eval", step))

    def on_save_point(self, trainer: Trainer, step: int, point: str) -> None:
        self.calls.append((f"on_save_point:{point}", step))

    def post_checkpoint(self, trainer: Trainer, step: int, path: Path) -> None:
        self.calls.append(("post_checkpoint", step))
        assert path.name == f"step_{step:08d}" and (path / "COMMITTED").is_file()

    def post_train(self, trainer: Trainer) -> None:
        self.calls.append(("post_train", trainer.step))


class FailsAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if step == self.step:
            raise ValueError(f"broken at step {step}")


def _trainer(tmp_path: Path, data: Path, overrides, callbacks: list[Callback], **extra: object) -> Trainer:
    cfg = load_config(None, overrides(tmp_path / "run", data, **{"checkpoint.export": False, **extra}))
    return Trainer(cfg, dist.init_distributed("none"), callbacks)


def test_hooks_run_in_order_with_the_step_they_belong_to(tmp_path, tiny_data, overrides, monkeypatch):
    monkeypatch.delenv("PIPE_FAULT", raising=False)
    recorder = Recorder()
    trainer = _trainer(
        tmp_path,
        tiny_data,
        overrides,
        [recorder],
        **{"train.max_steps": 4, "train.eval_every": 2, "train.eval_batches": 1, "checkpoint.every": 2},
    )
    assert trainer.train() == 0
    # The recorder is registered after the default callbacks, so at a step boundary it hears the evaluation and
    # the save (run by earlier callbacks' post_step) before its own post_step.
    expected: list[tuple[str, int]] = [("pre_train", 0)]
    for step in range(1, 5):
        expected += [("pre_step", step), ("pre_optim_step", step)]
        if step % 2 == 0:
            expected += [("on_eval", step)]
            expected += [(f"on_save_point:{point}", step) for point in SAVE_POINTS]
            expected += [("post_checkpoint", step)]
        expected += [("post_step", step)]
    expected += [("post_train", 4)]
    assert recorder.calls == expected
    assert recorder.trainer_step_at_post == {1: 1, 2: 2, 3: 3, 4: 4}
    tokens_per_step = trainer.cfg.tokens_per_step
    for step, metrics in recorder.metrics.items():
        assert metrics["tokens"] == step * tokens_per_step
        # Callbacks before the recorder added to the step's metrics: the retrieval telemetry of the tiny model.
        assert "retrieval_entropy_g0" in metrics and "retrieval_distance_g0" in metrics


def test_a_failing_callback_is_named_and_every_callback_still_cleans_up(tmp_path, tiny_data, overrides):
    recorder = Recorder()
    trainer = _trainer(tmp_path, tiny_data, overrides, [FailsAtStep(2), recorder], **{"train.max_steps": 4})
    with pytest.raises(ValueError, match="broken at step 2") as raised:
        trainer.train()
    assert "raised in the trainer callback FailsAtStep.post_step" in raised.value.__notes__
    # The dispatch of step 2 stopped at the failing callback; the recorder after it never heard of step 2 ...
    assert ("post_step", 1) in recorder.calls and ("post_step", 2) not in recorder.calls
    # ... but the cleanup reached every callback: the recorder, and the watchdog, whose thread is gone.
    assert recorder.calls[-1] == ("post_train", 2)
    watchdog = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
    assert watchdog.watchdog is None


def test_post_train_reaches_every_callback_and_re_raises_the_first_error():
    class FailsToClean(Callback):
        def post_train(self, trainer: Trainer) -> None:
            raise OSError("cannot close")

    cleaned: list[str] = []

    class Cleans(Callback):
        def post_train(self, trainer: Trainer) -> None:
            cleaned.append("done")

    callbacks = CallbackList([FailsToClean(), Cleans()])
    with pytest.raises(OSError, match="cannot close") as raised:
        callbacks.post_train(None)  # type: ignore[arg-type]  # neither callback looks at the trainer
    assert cleaned == ["done"]
    assert raised.value.__notes__ == ["raised in the trainer callback FailsToClean.post_train"]


def test_the_fault_injector_is_registered_only_when_a_fault_is_planned(tmp_path, tiny_data, overrides, monkeypatch):
    monkeypatch.delenv("PIPE_FAULT", raising=False)
    plain = _trainer(tmp_path, tiny_data, overrides, [])
    kinds = [type(cb) for cb in plain.callbacks]
    assert FaultInjector not in kinds
    assert SignalStop in kinds and kinds[-1] is CheckpointCadence and kinds[0] is HangWatchdog
    assert PeriodicEval not in kinds, "train.eval_every=0: no evaluation callback either"

    monkeypatch.setenv("PIPE_FAULT", "sigusr1:step=3:rank=1")
    planned = _trainer(tmp_path, tiny_data, overrides, [])
    injectors = [cb for cb in planned.callbacks if isinstance(cb, FaultInjector)]
    assert len(injectors) == 1 and injectors[0].plan.hits("sigusr1", 3, 1)


def test_a_finished_trainer_is_freed_without_the_cycle_collector(tmp_path, tiny_data, overrides, monkeypatch):
    """No reference cycle runs through the callbacks or the checkpoint manager: dropping the trainer frees it (and
    its readers drop the shards they hold in memory) at once, not at some later garbage collection; a local dataset
    is read without any shard cache on disk."""
    monkeypatch.delenv("PIPE_FAULT", raising=False)
    trainer = _trainer(tmp_path, tiny_data, overrides, [Recorder()], **{"train.max_steps": 3, "train.eval_every": 1})
    assert trainer.train() == 0
    freed = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert freed() is None
    finally:
        gc.enable()
    assert not (tmp_path / "run/data_cache").exists()

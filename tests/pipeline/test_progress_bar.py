"""The training progress bar shows each step's own loss, the one metrics.jsonl records for that step (issue 65,
finding 8: it showed the previous step's)."""

from __future__ import annotations

import re

import tqdm

from pipeline.train.trainer import main


class _EveryUpdate(tqdm.tqdm):
    """The trainer's bar, drawn at every update (tqdm draws at most every 0.1 s; the tiny steps take milliseconds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, mininterval=0, miniters=1)


def test_the_bar_shows_the_loss_of_the_step_it_counts(tmp_path, tiny_data, overrides, metrics, monkeypatch, capfd):
    monkeypatch.setattr(tqdm, "tqdm", _EveryUpdate)
    run = tmp_path / "run"
    args = {"logging.progress": True, "train.max_steps": 5, "train.eval_every": 0, "checkpoint.export": False}
    assert main("configs/train/debug.yaml", overrides(run, tiny_data, **args)) == 0
    frames = re.findall(r"(\d+)/5 \[[^\]]*loss=([0-9.]+)\]", capfd.readouterr().err)
    shown = {int(step): loss for step, loss in frames if int(step) > 0}
    assert sorted(shown) == [1, 2, 3, 4, 5], frames
    recorded = metrics(run)
    assert shown == {step: f"{recorded[step]['loss']:.4f}" for step in shown}
    assert len(set(shown.values())) > 1, "the losses differ from step to step, so a shifted bar would show"

"""Far recall in training: the validation pass of a real short run logs ``retrieval/far_recall`` and its companions
in the eval events of metrics.jsonl, equal to a direct measurement on the same validation batches; it leaves the
validation loss and the training RNG (Gumbel noise) as they were, and is absent for a model without retrieval."""

import json
from pathlib import Path

import pytest
import torch

from pipeline.evaluation.far_recall import FarRecall
from pipeline.train import dist
from pipeline.train.callbacks import PeriodicEval
from pipeline.train.config import load_config
from pipeline.train.trainer import Trainer, main

KEYS = {
    "retrieval/far_recall",
    "retrieval/far_recall_random",
    "retrieval/far_recall_nearest",
    "retrieval/far_recall_tokens",
}


def eval_events(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "eval"]


@pytest.mark.parametrize("retrieval", ["learned", "random"])
def test_validation_logs_far_recall_without_moving_the_training(tmp_path, tiny_data, overrides, metrics, retrieval):
    """The random retriever draws its picks from torch's RNG in the validation pass too."""
    settings = {
        "train.max_steps": 6,
        "train.eval_batches": 2,
        "checkpoint.export": False,
        "model.retrieval": retrieval,
    }
    with_eval, without = tmp_path / "eval", tmp_path / "plain"
    assert main(None, overrides(with_eval, tiny_data, **settings, **{"train.eval_every": 3})) == 0
    assert main(None, overrides(without, tiny_data, **settings)) == 0
    # Gumbel top-k (learned) or random picks: the losses after a validation pass equal a run without one's.
    assert [m["loss"] for m in metrics(with_eval).values()] == [m["loss"] for m in metrics(without).values()]
    events = eval_events(with_eval)
    assert [e["step"] for e in events] == [3, 6]
    for event in events:
        assert KEYS <= set(event) and event["retrieval/far_recall_tokens"] > 10
        assert 0 <= event["retrieval/far_recall"] <= 1 and 0 < event["retrieval/far_recall_random"] < 1


def test_far_recall_is_the_direct_measurement_and_leaves_the_loss_alone(tmp_path, tiny_data, overrides):
    cfg = load_config(None, overrides(tmp_path / "run", tiny_data, **{"train.eval_batches": 2}))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    evaluation = PeriodicEval(every=1)
    try:
        val_loss, logged = evaluation.evaluate(trainer)
        batches, error = evaluation._batches(trainer)
    finally:
        evaluation.post_train(trainer)
    assert error is None and len(batches) == 4  # 2 global batches of 2 micro-batches
    model = trainer.engine.module
    model.eval()
    want, losses = FarRecall.empty(1), []
    with torch.no_grad():
        for x in batches:
            losses.append(model(x, labels=x, return_logits=False).loss)  # no recording: the trainer's loss
            model.picks = {}
            model(x)
            for b in range(len(x)):
                want += FarRecall.measure(x[b].numpy(), model.picks, cfg.model, batch_row=b)
            model.picks = None
    assert val_loss == torch.stack(losses).mean().item()
    assert logged == {k: v for k, v in want.metrics("retrieval/").items() if v is not None}
    assert logged["retrieval/far_recall_tokens"] > 10


def test_no_far_recall_without_retrieval(tmp_path, tiny_data, overrides):
    cfg = load_config(None, overrides(tmp_path / "run", tiny_data, **{"model.arch": "swa"}))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    evaluation = PeriodicEval(every=1)
    try:
        _, logged = evaluation.evaluate(trainer)
    finally:
        evaluation.post_train(trainer)
    assert logged == {}

"""``model.arch=full`` through the trainer: it learns, logs no retrieval telemetry and its export reloads."""

import torch

from model import FullAttentionLM, build_model, load_pretrained
from pipeline.train import dist
from pipeline.train.config import load_config
from pipeline.train.parallel import blocks
from pipeline.train.trainer import Trainer


def test_the_blocks_sharded_and_checkpointed_are_the_full_attention_layers(tmp_path, tiny_data, overrides):
    cfg = load_config(None, overrides(tmp_path, tiny_data, **{"model.arch": "full"}))
    model = build_model(cfg.model)
    assert isinstance(model, FullAttentionLM)
    assert blocks(model) == list(model.layers) and len(model.layers) == 3


def test_full_attention_trains_and_its_export_reloads(tmp_path, tiny_data, overrides, metrics):
    run = tmp_path / "run"
    settings = {"model.arch": "full", "train.max_steps": 40, "optim.lr": 1e-2, "optim.min_lr": 1e-3}
    trainer = Trainer(load_config(None, overrides(run, tiny_data, **settings)), dist.init_distributed("none"))
    assert trainer.train() == 0
    steps = list(metrics(run).values())
    losses = [m["loss"] for m in steps]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < losses[0] - 0.4, losses
    assert not [key for m in steps for key in m if key.startswith("retrieval_")]

    exported = load_pretrained(run / "export")
    assert isinstance(exported, FullAttentionLM)
    x = torch.randint(0, 64, (2, 100))  # past train.seq_len=64
    trainer.engine.module.eval()
    with torch.no_grad():
        assert torch.equal(exported(x).logits, trainer.engine.module(x).logits)

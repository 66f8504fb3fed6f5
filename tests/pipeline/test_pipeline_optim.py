"""AdamW groups (no decay on norms, biases, embeddings, landmark) and the LR schedule in closed form."""

import math

import pytest
import torch
from helpers import tiny_config

from model import GCAForCausalLM
from pipeline.train.config import OptimConfig, ScheduleConfig
from pipeline.train.optim import build_optimizer, lr_at, param_groups, set_lr


def test_param_groups_split():
    cfg = tiny_config(vocab_size=64, d_model=32, ffn_hidden=64, chunk_size=8, window=16, gca_output_bias=True)
    model = GCAForCausalLM(cfg)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "embed.weight" in no_decay["names"] and "landmark" in no_decay["names"]
    assert all(n.endswith(".weight") for n in decay["names"])
    named = dict(model.named_parameters())
    assert all(named[n].ndim >= 2 for n in decay["names"])
    assert any(n.endswith("norm.weight") for n in no_decay["names"]) and any(
        n.endswith(".bias") for n in no_decay["names"]
    )
    assert len(decay["names"]) + len(no_decay["names"]) == len(named)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("warmup", [0, 5])
def test_schedule_closed_form(warmup):
    o, s, n = OptimConfig(lr=1e-3, min_lr=1e-4), ScheduleConfig(warmup_steps=warmup), 50
    lrs = [lr_at(k, n, o, s) for k in range(n)]
    for k in range(warmup):
        assert lrs[k] == pytest.approx(1e-3 * (k + 1) / warmup)
    assert lrs[warmup] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-12)  # min_lr is really reached at the last step
    mid = warmup + (n - 1 - warmup) / 2
    if mid.is_integer():
        assert lrs[int(mid)] == pytest.approx(5.5e-4)
    progress = [(k - warmup) / (n - 1 - warmup) for k in range(warmup, n)]
    expected = [1e-4 + 0.45e-3 * (1 + math.cos(math.pi * p)) for p in progress]
    assert lrs[warmup:] == pytest.approx(expected)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))
    assert min(lrs[warmup:]) == pytest.approx(1e-4)


def test_min_lr_reaches_the_optimizer():
    o, s = OptimConfig(lr=1e-2, min_lr=2e-3), ScheduleConfig(warmup_steps=2)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=o.lr)
    seen = []
    for k in range(10):
        set_lr(opt.param_groups, lr_at(k, 10, o, s))
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        opt.step()
    assert seen[-1] == pytest.approx(2e-3) and seen[2] == pytest.approx(1e-2)


def test_constant_decay():
    o, s = OptimConfig(lr=1e-3, min_lr=1e-4), ScheduleConfig(warmup_steps=2, decay="constant")
    assert [lr_at(k, 6, o, s) for k in range(6)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])

"""AdamW parameter groups and the learning-rate schedule.

Weight decay applies only to matrices of linear layers. Norm gains, biases, the embedding (which is also the
tied LM head) and the learned landmark vector get none: decaying them pulls gains toward 0 and shrinks rare
token embeddings, which the official code did.

The schedule is a closed form of the step, set on the optimizer before every update, so resuming needs only
the step counter and ``min_lr`` is exactly the final LR (upstream wrote ``min_lr`` where nothing read it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from pipeline.train.config import OptimConfig, ScheduleConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed AdamW group (names kept for logging).

    Decayed: parameters with 2+ dims that do not belong to an ``nn.Embedding``. Everything else (norms,
    biases, embeddings, the landmark vector) is not decayed.
    """
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embedding_params:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Torch AdamW over ``param_groups`` (also handed to DeepSpeed as its client optimizer)."""
    groups = [{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, cfg.weight_decay)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps)


def lr_at(step: int, max_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warm-up: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``. Then cosine from ``lr`` at
    ``step = warmup_steps`` to exactly ``min_lr`` at the last step ``max_steps - 1``.
    """
    w = schedule.warmup_steps
    if step < w:
        return optim.lr * (step + 1) / w
    if schedule.decay == "constant":
        return optim.lr
    span = max(max_steps - 1 - w, 1)
    progress = min((step - w) / span, 1.0)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(param_groups: Iterable[dict], lr: float) -> None:
    for group in param_groups:
        group["lr"] = lr

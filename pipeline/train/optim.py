"""AdamW parameter groups and the learning-rate schedule.

Weight decay applies only to matrices of linear layers. Norm gains, biases, the embedding (which is also the
tied LM head) and the learned landmark vector get none: decaying them pulls gains toward 0 and shrinks rare
token embeddings, which the official code did.

Staged training (continued pretraining from a dense model, docs/cpt.md): ``optim.trainable=new`` freezes the
dense parameters, ``optim.lr_scale`` gives each parameter role its own LR multiplier.

The schedule is a closed form of the step, set on the optimizer before every update, so resuming needs only
the step counter and ``min_lr`` is exactly the final LR (upstream wrote ``min_lr`` where nothing read it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn as nn

from model.convert import PARAMETER_ROLES, parameter_role
from pipeline.train.config import OptimConfig, ScheduleConfig


def param_groups(model: nn.Module, weight_decay: float, lr_scale: Mapping[str, float] | None = None) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed AdamW group (names kept for logging).

    Decayed: parameters with 2+ dims that do not belong to an ``nn.Embedding``. Everything else (norms,
    biases, embeddings, the landmark vector) is not decayed. With ``lr_scale`` (role -> LR multiplier,
    ``model.convert.parameter_role``) each of the two is split by role too, and every group carries its
    ``lr_scale`` (which ``set_lr`` applies); frozen parameters (``requires_grad=False``) are in no group.
    """
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    groups: dict[tuple[bool, str], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = p.ndim >= 2 and id(p) not in embedding_params
        role = parameter_role(name) if lr_scale is not None else ""
        group = groups.setdefault(
            (decayed, role), {"params": [], "weight_decay": weight_decay if decayed else 0.0, "names": []}
        )
        if lr_scale is not None:
            group["lr_scale"], group["role"] = lr_scale.get(role, 1.0), role
        group["params"].append(p)
        group["names"].append(name)
    if lr_scale is None:  # exactly two groups, the layout of every checkpoint written before per-role LRs
        for decayed in (True, False):
            groups.setdefault(
                (decayed, ""), {"params": [], "weight_decay": weight_decay if decayed else 0.0, "names": []}
            )
        return [groups[(True, "")], groups[(False, "")]]
    return [groups[key] for key in sorted(groups, key=lambda k: (not k[0], PARAMETER_ROLES.index(k[1])))]


def freeze_for_stage(model: nn.Module, cfg: OptimConfig) -> int:
    """``optim.trainable=new``: ``requires_grad=False`` on every ``dense`` parameter (before any engine wraps the
    model, so DDP, FSDP2 and DeepSpeed see them frozen). Returns the number of frozen parameter elements."""
    if cfg.trainable == "all":
        return 0
    frozen = 0
    for name, p in model.named_parameters():
        if parameter_role(name) == "dense":
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Torch AdamW over ``param_groups`` (also handed to DeepSpeed as its client optimizer)."""
    lr_scale = dict(cfg.lr_scale) if cfg.lr_scale else None
    groups = [
        {k: v for k, v in g.items() if k not in ("names", "role")}
        for g in param_groups(model, cfg.weight_decay, lr_scale)
    ]
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
    """``lr`` on every group, times the group's ``lr_scale`` where it has one (``optim.lr_scale``)."""
    for group in param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr

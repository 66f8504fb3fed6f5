"""The class each ``model.arch`` builds: the one place a model is constructed from its config."""

from __future__ import annotations

from model.baseline import SlidingWindowLM
from model.config import GCAConfig
from model.full import FullAttentionLM
from model.gca import GCAForCausalLM
from model.lm import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {"gca": GCAForCausalLM, "swa": SlidingWindowLM, "full": FullAttentionLM}
"""Keyed by ``model.config.ARCHS``, which the config validates against (it cannot import the models)."""


def build_model(cfg: GCAConfig) -> CausalLM:
    """The model named by ``cfg.arch``: ``GCAForCausalLM``, the ``SlidingWindowLM`` baseline or the
    ``FullAttentionLM`` baseline."""
    return MODEL_CLASSES[cfg.arch](cfg)

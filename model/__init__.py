"""GCA (DRT) language model and its baselines: ``GCAConfig``, ``build_model`` (``GCAForCausalLM``, ``SlidingWindowLM``,
``FullAttentionLM``), streaming state, export/import and the named sizes (``preset``)."""

from model.archs import build_model
from model.baseline import SlidingWindowLM
from model.config import ConfigError, GCAConfig
from model.full import FullAttentionLM
from model.gca import GCAForCausalLM
from model.io import load_pretrained, read_export_config, save_pretrained
from model.lm import CausalLM, CausalLMOutput, count_parameters, lm_loss
from model.presets import preset
from model.stream import StreamState

__all__ = [
    "CausalLM",
    "CausalLMOutput",
    "ConfigError",
    "FullAttentionLM",
    "GCAConfig",
    "GCAForCausalLM",
    "SlidingWindowLM",
    "StreamState",
    "build_model",
    "count_parameters",
    "lm_loss",
    "load_pretrained",
    "preset",
    "read_export_config",
    "save_pretrained",
]

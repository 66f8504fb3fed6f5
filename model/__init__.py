"""GCA (DRT) language model: ``GCAConfig``, ``GCAForCausalLM``, streaming state and export/import."""

from model.baseline import SlidingWindowLM, build_model
from model.config import ConfigError, GCAConfig
from model.gca import GCAForCausalLM
from model.io import load_pretrained, read_export_config, save_pretrained
from model.lm import CausalLM, CausalLMOutput, count_parameters, lm_loss
from model.stream import StreamState

__all__ = [
    "CausalLM",
    "CausalLMOutput",
    "ConfigError",
    "GCAConfig",
    "GCAForCausalLM",
    "SlidingWindowLM",
    "StreamState",
    "build_model",
    "count_parameters",
    "lm_loss",
    "load_pretrained",
    "read_export_config",
    "save_pretrained",
]

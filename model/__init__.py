"""GCA (DRT) language model: ``GCAConfig``, ``GCAForCausalLM``, streaming state and export/import."""

from model.baseline import SlidingWindowLM, build_model
from model.config import ConfigError, GCAConfig
from model.gca import GCAForCausalLM, GCAOutput
from model.io import load_pretrained, read_export_config, save_pretrained
from model.stream import StreamState

__all__ = [
    "ConfigError",
    "GCAConfig",
    "GCAForCausalLM",
    "GCAOutput",
    "SlidingWindowLM",
    "StreamState",
    "build_model",
    "load_pretrained",
    "read_export_config",
    "save_pretrained",
]

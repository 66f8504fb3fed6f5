"""``transformers`` configuration of an exported GCA model (shipped in every export as ``configuration_gca.py``).

An export's ``config.json`` is read by two loaders: this repository's ``model.io.read_export_config`` uses its
``model`` (every ``GCAConfig`` field) and ``export`` (training metadata) objects; ``transformers`` reads the same
file through this class, which keeps both objects as they are and exposes what generic tools look for
(``vocab_size``, special token ids).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class GCAHFConfig(PretrainedConfig):
    model_type = "gca"

    def __init__(
        self, model: dict[str, Any] | None = None, export: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self.model = dict(model or {})
        """The native ``GCAConfig`` fields (``GCAConfig.from_dict`` validates them when the model is built)."""
        self.export = dict(export or {})
        """Export metadata written by the trainer (step, training length, tokenizer file)."""
        kwargs.pop("vocab_size", None)  # derived from ``model``, never set on its own
        # The LM head is the embedding matrix inside the native model; there is no separate head to tie.
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.vocab_size = self.model.get("vocab_size")

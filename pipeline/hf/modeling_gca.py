"""``transformers`` model of an exported GCA model (shipped in every export as ``modeling_gca.py``).

``GCAHFForCausalLM`` wraps the repository's own model (``model.archs.build_model``), so the logits are the native
ones. Generation carries the native streaming state between decode steps (``GCAStreamCache``): each new token runs
one ``forward_stream`` step against the window caches, the chunk memory and the retrieval rows, so the cost of a
token does not grow with a re-read prefix.

Padding: without a cache, rows are scored in one batch (right padding cannot reach earlier positions of a causal
model, which is what lm-eval's ``hf`` model relies on); a row with masked positions anywhere (left padding in
``generate``) is run on its real tokens alone, with its own stream state, since chunk boundaries count real tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from model.archs import build_model
from model.config import GCAConfig
from model.lm import CausalLM, lm_loss
from model.stream import StreamState
from pipeline.hf.configuration_gca import GCAHFConfig

_SHIPPED_BACKENDS = {"gca_backend": {"auto": "matmul", "triton": "matmul"}, "swa_backend": {"gpu": "auto"}}
"""The folder ships the PyTorch operators only (no Triton kernels, no GPU sliding-window module), so backends that
need those are replaced by the PyTorch paths, which compute the same attention."""


def native_config(config: GCAHFConfig) -> GCAConfig:
    """The model's ``GCAConfig``, with backends the exported folder cannot run replaced by shipped ones."""
    fields = GCAConfig.from_dict(config.model).to_dict()
    for key, replace in _SHIPPED_BACKENDS.items():
        fields[key] = replace.get(fields[key], fields[key])
    return GCAConfig.from_dict(fields)


class GCAStreamCache:
    """Native stream states carried by ``generate`` between steps: one batched state when the batch has no padding,
    else one state per row (fed that row's real tokens only)."""

    def __init__(self) -> None:
        self.states: list[StreamState] = []
        self.per_row = False
        self.seen = 0
        """Positions consumed so far, padding included (the width of ``attention_mask`` covered)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen


# transformers' own stubs declare generation_config differently in its two bases (every HF causal LM has this).
class GCAHFForCausalLM(PreTrainedModel, GenerationMixin):  # type: ignore[misc]
    config_class = GCAHFConfig
    base_model_prefix = "gca"
    """The export's tensors are named as in the native model; ``transformers`` adds this prefix when loading."""
    main_input_name = "input_ids"
    _is_stateful = True  # the cache is the native stream state: generate must not build a key/value cache

    def __init__(self, config: GCAHFConfig) -> None:
        super().__init__(config)
        self.gca: CausalLM = build_model(native_config(config))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """The native model initialises itself; loaded weights replace that."""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.gca.embed

    def get_output_embeddings(self) -> None:
        return None  # the LM head reuses the input embedding inside the native model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: GCAStreamCache | None = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, V]`` for ``input_ids [B, T]``; ``attention_mask [B, past + T]`` marks real tokens
        (masked positions get zero logits). With ``use_cache`` (or a ``past_key_values`` from an earlier call) the
        input continues the cached sequence and the returned cache holds the state after it."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        mask = None if attention_mask is None else attention_mask[:, -input_ids.shape[1] :].bool()
        if past_key_values is None and not use_cache:
            logits, cache = self._whole(input_ids, mask), None
        else:
            cache = past_key_values if past_key_values is not None else GCAStreamCache()
            logits = self._stream(input_ids, mask, cache)
        loss = None if labels is None else lm_loss(logits, labels)
        # The output type is annotated with the legacy FloatTensor class and transformers' key/value Cache; the
        # values are plain fp32 tensors and the native stream cache, which is what generate hands back to forward.
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)  # type: ignore[arg-type]

    def _whole(self, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None or bool(mask.all()):
            return self.gca(input_ids).logits
        logits = self._zeros(input_ids)
        for b in range(input_ids.shape[0]):
            if mask[b].any():
                logits[b, mask[b]] = self.gca(input_ids[b, mask[b]][None]).logits[0]
        return logits

    def _stream(self, input_ids: torch.Tensor, mask: torch.Tensor | None, cache: GCAStreamCache) -> torch.Tensor:
        padded = mask is not None and not bool(mask.all())
        if not cache.states:
            cache.per_row = padded
            n_states = input_ids.shape[0] if padded else 1
            cache.states = [self.gca.new_stream_state() for _ in range(n_states)]
        elif padded and not cache.per_row:
            raise ValueError("attention_mask masks new positions of a sequence that was started without padding")
        cache.seen += input_ids.shape[1]
        if not cache.per_row:
            return self.gca.forward_stream(input_ids, cache.states[0])
        logits = self._zeros(input_ids)
        for b, state in enumerate(cache.states):
            real = mask[b] if mask is not None else torch.ones_like(input_ids[b], dtype=torch.bool)
            if real.any():
                logits[b, real] = self.gca.forward_stream(input_ids[b, real][None], state)[0]
        return logits

    def _zeros(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.gca.embed.weight
        return weight.new_zeros(*input_ids.shape, weight.shape[0])

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Any = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Only the positions the cache (a ``GCAStreamCache``) has not seen yet are fed: one token per decode step."""
        if inputs_embeds is not None:
            raise ValueError("GCA generation starts from input_ids (landmarks are inserted between token embeddings)")
        unseen = input_ids if past_key_values is None else input_ids[:, past_key_values.get_seq_length() :]
        return {
            "input_ids": unseen,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache"),
        }

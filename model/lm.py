"""What every causal LM here shares: the output type, the next-token loss and parameter counting.

``GCAForCausalLM`` and the baselines (``SlidingWindowLM``, ``FullAttentionLM``) derive from ``CausalLM``; the
trainer's token-weighted loss calls ``lm_loss`` too, so there is one definition of "the loss" whichever way it is
asked for.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.chunk_store import ChunkStore
from model.chunked_loss import chunked_lm_loss, chunked_lm_loss_and_token_losses, shifted_targets
from model.config import GCAConfig
from model.context_parallel import ContextParallel
from model.retrieval import NeedleLabels
from model.stream import StreamState


class CausalLMOutput(NamedTuple):
    """What ``forward`` returns: ``logits [B, T, vocab_size]`` (``logits[:, t]`` predicts token ``t + 1``) and
    ``loss``, the mean next-token cross-entropy when labels were given.

    A named tuple, not a dataclass: sharding wrappers hook the tensors a module returns to gather its parameters
    again before its backward, and they find those tensors by walking tuples, lists and dicts. FSDP2 in torch 2.11
    (``tree_flatten``) and DeepSpeed ZeRO-3 (``apply_to_tensors_only``) see a dataclass as one opaque value, so the
    root's hook was never placed and the LM head's backward read a freed weight (docs/training.md, "FSDP2 and the
    model's output").
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    token_loss: torch.Tensor | None = None
    """With ``forward(..., token_loss=True)`` and labels: each position's own next-token cross-entropy ``[B, T]``
    (fp32, detached; `token_losses`' layout), the terms ``loss`` averages. Else ``None``."""
    needle_loss: torch.Tensor | None = None
    """With ``forward(..., retrieval_labels=...)``: the retriever's supervised loss (``model.retrieval.needle_loss``,
    per sequence, averaged over the retrieval groups), not included in ``loss``. Else ``None``."""


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    weight_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy of ``logits [B, T, V]`` against ``labels [B, T]`` aligned with the inputs
    (Hugging Face convention: ``logits[:, t]`` is scored against ``labels[:, t + 1]``), computed in fp32.

    Without ``weights``: the mean over the positions whose label is not ``-100``. With ``weights [B, T]``
    (aligned like ``labels``): ``sum(w * ce)`` over the predicted positions divided by ``weight_norm``, by default
    their own ``sum(w)`` (the batch's weighted mean). The trainer passes the mean weight sum per micro-batch of the
    whole global batch instead, so that its micro-batches add up to the global batch's weighted mean however the
    batch is split (``pipeline.train.trainer.Trainer.train_step``).
    """
    flat_logits = logits[:, :-1].flatten(0, 1).float()
    targets = labels[:, 1:].flatten()
    if weights is None:
        return F.cross_entropy(flat_logits, targets, ignore_index=-100)
    return weighted_lm_loss(logits, labels, weights, weight_norm)[0]


def weighted_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, weight_norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_loss` with ``weights`` (the same computation), and each position's unweighted cross-entropy ``[B, T]``
    (fp32, detached; `token_losses`' layout) from the same pass."""
    flat_logits = logits[:, :-1].flatten(0, 1).float()
    targets = labels[:, 1:].flatten()
    ce = F.cross_entropy(flat_logits, targets, reduction="none")  # 0 at a -100 label
    w = weights[:, 1:].flatten()
    loss = (ce * w).sum() / (w.sum() if weight_norm is None else weight_norm)
    return loss, F.pad(ce.detach().view(labels.shape[0], -1), (0, 1))


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token cross-entropy ``[B, T]`` in fp32 (no gradient): position ``t`` of ``logits [B, T,
    V]`` scored against ``labels[:, t + 1]``; 0 at the last position and where the label is ``-100``, which score
    nothing. Summed over a row and divided by the row's scored positions, the row's mean loss."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float().detach(), labels[:, 1:].flatten(), reduction="none")
    return F.pad(ce.view(labels.shape[0], -1), (0, 1))


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """Which positions of ``labels [B, T]`` (aligned with the inputs) are scored: ``[B, T]`` bool, False at the last
    position and before a ``-100`` label (`token_losses`' layout)."""
    return shifted_targets(labels) != -100


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements of ``module`` (each shared tensor counted once)."""
    return sum(p.numel() for p in module.parameters())


def _mean(needle: NeedleLabels | None) -> torch.Tensor | None:
    return None if needle is None else needle.mean()


class CausalLM(nn.Module):
    """Base of the language models: ``forward(input_ids, labels)`` over a whole sequence, the streaming interface
    the evaluation drives (``new_stream_state``, ``forward_stream``, ``window_reach``) and parameter counting.

    A subclass owns an ``embed`` table (its LM head too, unless ``head`` is set) and implements ``_step(input_ids,
    state)``, the one code path that turns tokens into logits, with ``state=None`` for a whole sequence, plus the
    streaming methods.
    """

    cfg: GCAConfig
    embed: nn.Embedding
    head: nn.Linear | None
    """``None`` when the LM head is the embedding matrix (``model.tie_embeddings``, the default)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cp: ContextParallel | None = None,
        return_logits: bool = True,
        token_loss: bool = False,
        retrieval_labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Logits for every token of ``input_ids [B, T]``; the mean next-token loss (``lm_loss``) when ``labels``
        (aligned with ``input_ids``, ``-100`` ignored) are given.

        ``return_logits=False`` with ``labels`` (the trainer's loss): the loss is computed by ``chunked_lm_loss``
        from the final hidden states, never holding the whole ``[B, T, vocab]`` logits, and ``logits`` is an empty
        ``[B, 0, vocab]`` tensor.

        ``cp``: ``input_ids`` is this rank's span of a sequence split over a context-parallel group (what
        ``model.context_parallel.cp_loss`` passes; it scores the span itself, so no ``labels``). The span goes
        through the module call rather than ``_step`` so that wrappers' forward hooks run (FSDP2 unshards the
        root-level parameters there).

        ``token_loss`` (with ``labels``): also return each position's cross-entropy (``CausalLMOutput.token_loss``),
        from the same pass; the loss and its gradients are unchanged.

        ``retrieval_labels [B, C]`` (a whole sequence, no ``cp``): also return the retriever's supervised loss on
        the retrieval tasks they mark (``CausalLMOutput.needle_loss``; ``model.retrieval.needle_loss``).
        """
        needle = None if retrieval_labels is None else NeedleLabels(retrieval_labels)
        if needle is not None and cp is not None:
            raise ValueError("retrieval_labels need the whole sequence: not under context parallelism")
        if cp is None and labels is not None and not return_logits:
            hidden = self._whole(input_ids, needle, hidden=True)
            per_token = None
            if token_loss:
                loss, per_token = chunked_lm_loss_and_token_losses(hidden, self.head_weight, labels)
            else:
                loss = chunked_lm_loss(hidden, self.head_weight, labels)
            empty = loss.new_empty(input_ids.shape[0], 0, self.cfg.vocab_size)
            return CausalLMOutput(logits=empty, loss=loss, token_loss=per_token, needle_loss=_mean(needle))
        if cp is None:
            logits = self._whole(input_ids, needle, hidden=False)
        elif labels is not None:
            raise ValueError("a context-parallel span is scored by cp_loss, which needs the peers' labels: no labels")
        else:
            logits = self._cp_step(input_ids, cp)
        if labels is None:
            return CausalLMOutput(logits=logits, needle_loss=_mean(needle))
        per_token = token_losses(logits, labels) if token_loss else None
        return CausalLMOutput(
            logits=logits, loss=lm_loss(logits, labels), token_loss=per_token, needle_loss=_mean(needle)
        )

    def _whole(self, input_ids: torch.Tensor, needle: NeedleLabels | None, *, hidden: bool) -> torch.Tensor:
        """``_step`` over a whole sequence, collecting ``needle_loss`` terms into ``needle`` when it is given."""
        if needle is None:
            return self._step(input_ids, None, hidden=hidden)
        return self._needle_step(input_ids, needle, hidden=hidden)

    def _needle_step(self, input_ids: torch.Tensor, needle: NeedleLabels, *, hidden: bool) -> torch.Tensor:
        """``_step`` of a whole sequence that also adds each retrieval group's ``needle_loss`` to ``needle``; only
        a model with a retriever has one."""
        raise ValueError(f"{type(self).__name__} has no retriever to supervise (retrieval_labels need model.arch=gca)")

    def _step(self, input_ids: torch.Tensor, state: StreamState | None, *, hidden: bool = False) -> torch.Tensor:
        """Logits of ``input_ids`` continuing ``state`` (``None``: a whole sequence); with ``hidden`` the final
        normalised hidden states ``[B, T, d_model]`` the LM head would read instead."""
        raise NotImplementedError

    def _cp_step(self, input_ids: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        """Logits of this rank's span under context parallelism; only the GCA model supports it."""
        raise NotImplementedError(f"{type(self).__name__} has no context parallelism (it needs model.arch=gca)")

    def new_stream_state(self, memory: ChunkStore | None = None) -> StreamState:
        """A fresh state for ``forward_stream``; ``memory`` replaces the in-RAM chunk memory."""
        raise NotImplementedError

    def forward_stream(
        self, input_ids: torch.Tensor, state: StreamState, last_logits: int | None = None, memory_only: bool = False
    ) -> torch.Tensor:
        """Continue the sequence in ``state`` with ``input_ids [B, t]``; logits ``[B, t, V]`` (or of the last
        ``last_logits`` tokens; none with ``memory_only``)."""
        raise NotImplementedError

    @property
    def window_reach(self) -> int | None:
        """Tokens after ``memory_only`` steps from which logits are exact again (``None``: unsupported)."""
        raise NotImplementedError

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's ``[vocab, d_model]`` matrix: the tied embedding matrix, or the untied ``head``'s."""
        return self.embed.weight if self.head is None else self.head.weight

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states ``h [..., d_model]``: the tied embedding matrix, or the untied ``head``."""
        return F.linear(h, self.embed.weight) if self.head is None else self.head(h)

    def init_normal_weights(self) -> None:
        """N(0, ``init_std``) for every linear and embedding weight, zero biases (the baselines' whole
        initialisation; norm gains keep their ones)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        n = count_parameters(self)
        return n - self.embed.weight.numel() if exclude_embedding else n

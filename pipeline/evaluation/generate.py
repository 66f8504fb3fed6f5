"""Sampling from an export with bounded memory: the prompt is streamed by segments, then one token per step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from model import CausalLM, StreamState
from pipeline.evaluation.runtime import StreamBudget, stream_segments, stream_state


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Refuse sampling settings that would fail (or silently misbehave) inside torch.

    Raises:
        ValueError: a negative or non-finite temperature, top_k < 0, or top_p outside (0, 1] (NaN included).
    """
    # NaN fails every comparison: written as "not in range" so it is refused, not waved through.
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = off)")


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """One token from ``logits [V]``: greedy at temperature 0, else temperature + top-k (0: off) + top-p (1: off).

    Raises:
        ValueError: see ``check_sampling``.
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_token(logits: torch.Tensor) -> int:
    """The most likely token of ``logits [V]`` (``sample_token`` at temperature 0)."""
    return int(logits.float().argmax())


def prefill(
    model: CausalLM,
    state: StreamState,
    ids: torch.Tensor,
    segment: int,
    on_tokens: Callable[[int], None] | None = None,
    skip_far_layers: bool = False,
) -> torch.Tensor:
    """Stream the prompt ``ids [1, T]`` (``T >= 1``) into ``state`` by segments; return the logits ``[V]`` of its
    last token, the ones the first new token is picked from.

    ``skip_far_layers``: stream all but the last ``model.window_reach`` tokens with ``memory_only`` (the same
    last logits; only the chunk memory and the lower layers see the far prefix, see
    ``GCAForCausalLM.forward_stream``). Models without ``window_reach`` stream everything.
    """
    reach = getattr(model, "window_reach", None) if skip_far_layers else None
    split = 0 if reach is None else max(0, ids.shape[1] - reach) // segment * segment
    for _ in stream_segments(model, state, ids[:, :split], segment, on_tokens, memory_only=True):
        pass
    for _, logits in stream_segments(model, state, ids[:, split:], segment, on_tokens, last_only=True):
        last = logits[0, -1]
    return last


def decode(
    model: CausalLM,
    state: StreamState,
    last: torch.Tensor,
    max_new_tokens: int,
    *,
    pick: Callable[[torch.Tensor], int] = greedy_token,
    stop_ids: tuple[int, ...] = (),
    on_tokens: Callable[[int], None] | None = None,
) -> Iterator[int]:
    """The decode loop: pick a token from ``last`` (logits ``[V]``), yield it, feed it back through ``state`` for
    the next logits; stops after ``max_new_tokens`` tokens or a token in ``stop_ids`` (yielded)."""
    device = next(model.parameters()).device
    for i in range(max_new_tokens):
        token = pick(last)
        yield token
        if token in stop_ids or i + 1 == max_new_tokens:
            return
        with torch.inference_mode():
            last = model.forward_stream(torch.tensor([[token]], device=device), state)[0, -1]
        if on_tokens is not None:
            on_tokens(1)


@dataclass(frozen=True)
class Sampling:
    """How ``generate`` picks each token: greedy at temperature 0, else temperature + top-k + top-p, seeded."""

    temperature: float = 1.0
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens reaching this probability (1: off)."""
    seed: int = 0


PLAIN_SAMPLING = Sampling()
"""Temperature 1 over the whole vocabulary."""
GENERATE_BUDGET = StreamBudget(offload_mb=1024)
"""Generation keeps 1 GiB of chunk K/V in RAM per sequence before spilling, as ``launch/generate.py`` does."""


def generate(
    model: CausalLM,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: Sampling = PLAIN_SAMPLING,
    stop_ids: tuple[int, ...] = (),
    budget: StreamBudget = GENERATE_BUDGET,
) -> Iterator[int]:
    """Yield sampled token ids one by one (stops after ``max_new_tokens`` or a token in ``stop_ids``).

    Raises:
        ValueError: an empty prompt, or bad sampling settings (``check_sampling``), before any token is computed.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    check_sampling(sampling.temperature, sampling.top_k, sampling.top_p)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)

    def pick(logits: torch.Tensor) -> int:
        return sample_token(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)

    with stream_state(model, budget) as state:
        last = prefill(model, state, torch.tensor([prompt], device=device), budget.segment)
        yield from decode(model, state, last, max_new_tokens, pick=pick, stop_ids=stop_ids)

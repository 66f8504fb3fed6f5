"""Sampling from an export with bounded memory: the prompt is streamed by segments, then one token per step."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from model import GCAForCausalLM
from pipeline.evaluation.runtime import stream_segments, stream_state


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


def generate(
    model: GCAForCausalLM,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
    segment: int = 4096,
    offload_mb: int = 1024,
    offload_dir: str | None = None,
) -> Iterator[int]:
    """Yield sampled token ids one by one (stops after ``max_new_tokens`` or a token in ``stop_ids``).

    Raises:
        ValueError: an empty prompt, or bad sampling settings (``check_sampling``), before any token is computed.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    check_sampling(temperature, top_k, top_p)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    with stream_state(model, offload_mb, offload_dir) as state:
        ids = torch.tensor([prompt], device=device)
        for _, logits in stream_segments(model, state, ids, segment, last_only=True):
            last = logits[0, -1]
        for i in range(max_new_tokens):
            token = sample_token(last, temperature, top_k, top_p, generator)
            yield token
            if token in stop_ids or i + 1 == max_new_tokens:
                return
            with torch.inference_mode():
                last = model.forward_stream(torch.tensor([[token]], device=device), state)[0, -1]

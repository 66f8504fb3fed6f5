"""Perplexity vs length (the official script reported the mean NLL as ppl): ppl = exp(mean token NLL), not the mean NLL.

For each length ``L`` the corpus is cut into non-overlapping windows of ``L`` tokens from its start; each window
is evaluated independently from an empty memory, streamed segment by segment (same logits as one full forward),
and every predicted position (``L - 1`` per window) counts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from model import CausalLM
from pipeline.evaluation.runtime import stream_segments, stream_state

log = logging.getLogger(__name__)


def window_nll(
    model: CausalLM,
    ids: torch.Tensor,
    segment: int,
    offload_mb: int = -1,
    offload_dir: str | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[float, int]:
    """Summed next-token NLL (fp64) and the number of predictions over ``ids [B, T]``, streamed by segments."""
    total, count = 0.0, 0
    with stream_state(model, offload_mb, offload_dir) as state:
        device_ids = ids.to(model.embed.weight.device)
        for start, logits in stream_segments(model, state, device_ids, segment, on_tokens):
            # logits[:, j] predicts token start + j + 1, which may sit in the next segment: ids holds it already.
            target = device_ids[:, start + 1 : start + 1 + logits.shape[1]]
            pred = logits[:, : target.shape[1]].float()
            total += F.cross_entropy(pred.flatten(0, 1), target.flatten(), reduction="sum").item()
            count += target.numel()
    return total, count


def evaluate_ppl(
    model: CausalLM,
    tokens: np.ndarray,
    lengths: list[int],
    samples: int,
    segment: int,
    offload_mb: int = -1,
    offload_dir: str | None = None,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
) -> list[dict]:
    """One result row per length: ``{"length", "ppl", "nll", "n", "tokens", "seconds", "tokens_per_s"}``.

    Args:
        tokens: the corpus token stream (at least one window of the longest length).
        samples: windows per length (fewer if the corpus runs out; ``n`` says how many were used).
        progress: ``progress(length, total_tokens)`` returns a per-segment callback (e.g. a tqdm update).

    Raises:
        ValueError: the corpus is shorter than one window of some length.
    """
    rows = []
    for length in lengths:
        n = min(samples, len(tokens) // length)
        if n == 0:
            raise ValueError(f"the data holds {len(tokens)} tokens, fewer than one window of length={length}")
        if n < samples:
            log.warning("length %d: the data holds only %d of the %d windows asked for", length, n, samples)
        on_tokens = progress(length, n * length) if progress else None
        t0 = time.perf_counter()
        total, count = 0.0, 0
        for i in range(n):
            window = torch.from_numpy(tokens[i * length : (i + 1) * length].astype(np.int64))[None]
            nll, m = window_nll(model, window, segment, offload_mb, offload_dir, on_tokens)
            total, count = total + nll, count + m
        seconds = time.perf_counter() - t0
        mean = total / count
        rows.append(
            {
                "length": length,
                "ppl": math.exp(mean),
                "nll": mean,
                "n": n,
                "tokens": count,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(n * length / seconds, 1),
            }
        )
        log.info("ppl length=%d: %.3f (%d windows, %.1fs)", length, math.exp(mean), n, seconds)
    return rows

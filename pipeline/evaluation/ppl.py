"""Perplexity by context length on identical tokens, and whole-document streaming perplexity.

ppl = exp(mean token NLL) (the official script reported the mean NLL as ppl).

``context_ppl``: for every document ``d`` of ``N`` tokens and every context length ``L``, the same final
``score_len`` tokens of ``d`` are scored, with the ``L - score_len`` tokens before them as context: the model
streams tokens ``[N - L, N - 1)`` from a fresh state and the targets are ``d[N - score_len:]``. Lengths are
compared on the same text, so a change of ppl with ``L`` is the effect of context alone.

``document_ppl``: every predicted position of each whole document, streamed from its start.

For GCA models each ``context_ppl`` row also holds the far recall of its scored tokens
(``pipeline.evaluation.far_recall``): how often the retrieval row that served a scored token's prediction held a
chunk with an earlier occurrence of its n-gram beyond the sliding windows' reach, against random picks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from model import CausalLM, GCAForCausalLM
from model.retrieval import Picks
from pipeline.evaluation.far_recall import FarRecall
from pipeline.evaluation.runtime import IN_RAM, StreamBudget, stream_segments, stream_state

log = logging.getLogger(__name__)

Progress = Callable[[int, int], Callable[[int], None]]
"""``progress(length, total_tokens)`` returns a per-segment callback (e.g. a tqdm update)."""
LabelledProgress = Callable[[str, int], Callable[[int], None]]
"""``progress(label, total_tokens)``, for a pass that is no one context length (``whole documents``)."""


MAX_DEFAULT_SCORE_LEN = 1024


def default_score_len(shortest: int) -> int:
    """The scored tail when none is given: half the shortest context length, at most 1024 tokens. Half leaves as
    much context as it scores, so a length equal to the training length still gets context, and any length >= 2
    gets a valid value; the cap keeps long lengths comparable with the earlier fixed default of 1024."""
    return max(1, min(shortest // 2, MAX_DEFAULT_SCORE_LEN))


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in fp32 for the log-softmax; fp32 and fp64 ones as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def window_nll(
    model: CausalLM,
    ids: torch.Tensor,
    *,
    budget: StreamBudget = IN_RAM,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[float, int]:
    """Summed next-token NLL (fp64) and the number of predictions over ``ids [B, T]``, streamed by segments."""
    total, count = 0.0, 0
    with stream_state(model, budget) as state:
        device_ids = ids.to(model.embed.weight.device)
        for start, logits in stream_segments(model, state, device_ids, budget.segment, on_tokens):
            # logits[:, j] predicts token start + j + 1, which may sit in the next segment: ids holds it already.
            target = device_ids[:, start + 1 : start + 1 + logits.shape[1]]
            pred = at_least_fp32(logits[:, : target.shape[1]])
            total += F.cross_entropy(pred.flatten(0, 1), target.flatten(), reduction="sum").item()
            count += target.numel()
    return total, count


def scored_tail_nll(
    model: CausalLM,
    document: np.ndarray,
    *,
    length: int,
    score_len: int,
    budget: StreamBudget = IN_RAM,
    on_tokens: Callable[[int], None] | None = None,
    picks: Picks | None = None,
) -> tuple[float, range]:
    """Summed NLL (fp64) of the last ``score_len`` tokens of ``document`` with ``length - score_len`` tokens of
    context, and the document positions of the targets actually scored (for the caller's bookkeeping check).
    ``picks``: filled with the retrievals scored (``StreamState.picks``; chunk ids count from the window's start,
    document position ``len(document) - length``).

    Segments that end ``window_reach`` tokens or more before the first scored logit are streamed with
    ``memory_only`` (no logits; what later tokens read is kept, see ``GCAForCausalLM.forward_stream``), so the
    scored logits are the same as a full forward's; the rest only computes the logits that are scored.
    """
    n = len(document)
    offset = n - length  # document position of the window's first token
    device = next(model.parameters()).device
    inputs = torch.tensor(document[offset : n - 1], dtype=torch.long, device=device)[None]
    targets = torch.tensor(document, dtype=torch.long, device=device)
    first = length - 1 - score_len  # window index of the first scored logit
    reach = getattr(model, "window_reach", None)
    skip = 0 if reach is None else max(0, first - reach + 1)
    total, lo, hi = 0.0, None, None
    with stream_state(model, budget) as state:
        state.picks = picks
        for start in range(0, inputs.shape[1], budget.segment):
            piece = inputs[:, start : start + budget.segment]
            end = start + piece.shape[1]
            with torch.inference_mode():
                if end <= skip:
                    model.forward_stream(piece, state, memory_only=True)
                elif end <= first:  # no logits: it fills the windows the scored logits read
                    model.forward_stream(piece, state, last_logits=0)
                else:
                    k = end - max(start, first)
                    logits = model.forward_stream(piece, state, last_logits=k)[:, -k:]
                    # logits[:, j] sits at window index end - k + j and predicts the token after it.
                    a, b = offset + end - k + 1, offset + end + 1
                    total += F.cross_entropy(at_least_fp32(logits[0]), targets[a:b], reduction="sum").item()
                    lo, hi = a if lo is None else lo, b
            if on_tokens is not None:
                on_tokens(piece.shape[1])
    return total, range(0) if lo is None or hi is None else range(lo, hi)


def too_short(length: int, longest: int) -> ValueError:
    """The error for a context length no document is long enough for."""
    return ValueError(
        f"length={length}: no document holds {length} tokens (the longest holds {longest}); evaluate shorter "
        "lengths, or cut the token stream into windows of the longest length (eval key ppl_documents=windows)"
    )


def context_ppl(
    model: CausalLM,
    documents: Sequence[np.ndarray],
    *,
    lengths: list[int],
    score_len: int,
    budget: StreamBudget = IN_RAM,
    progress: Progress | None = None,
    same_documents: bool = True,
    samples: int | None = None,
) -> list[dict]:
    """One row per length: ``{"kind": "context", "length", "ppl", "nll", "tokens", "documents", "seconds",
    "tokens_per_s"}`` (``nll``: mean per scored token; ``tokens``: scored tokens; ``tokens_per_s``: tokens
    streamed through the model per second); for a GCA model also ``far_recall``, ``far_recall_random``,
    ``far_recall_nearest`` (None when no scored token qualified), ``far_recall_tokens`` and with several groups
    ``far_recall_g<i>``
    (``FarRecall.metrics``) over the scored tokens.

    Args:
        documents: int64 token arrays, in source order.
        same_documents: every length scores the documents long enough for the longest length (identical scored
            tokens across lengths); False: each length scores the documents holding at least ``length`` tokens.
        samples: the most documents per length (the first eligible ones); None: all eligible.

    Raises:
        ValueError: ``score_len < 1``, a length not above ``score_len``, or a length no document is long enough for
            (naming the length and the longest document).
        AssertionError: a document was scored at different positions for different lengths (a bookkeeping bug).
    """
    if score_len < 1:
        raise ValueError(f"score_len={score_len} must be >= 1")
    if any(length <= score_len for length in lengths):
        raise ValueError(f"lengths={lengths}: each must be > score_len={score_len} (some tokens of context)")
    longest = max((len(d) for d in documents), default=0)
    plan = []
    for length in lengths:  # every length is checked before any work
        need = max(lengths) if same_documents else length
        plan.append((length, [i for i, d in enumerate(documents) if len(d) >= need][:samples]))
        if not plan[-1][1]:
            raise too_short(need, longest)
    rows: list[dict] = []
    for length, chosen in plan:
        on_tokens = progress(length, len(chosen) * (length - 1)) if progress else None
        t0 = time.perf_counter()
        total = 0.0
        recall = FarRecall.empty(len(model.cfg.groups)) if isinstance(model, GCAForCausalLM) else None
        for i in chosen:
            picks: Picks | None = {} if recall is not None else None
            nll, positions = scored_tail_nll(
                model, documents[i], length=length, score_len=score_len, budget=budget, on_tokens=on_tokens, picks=picks
            )
            total += nll
            if recall is not None and picks is not None:
                # The stream covers the window's tokens; the last target lies one past it (no logit reads it).
                window = documents[i][len(documents[i]) - length :]
                scored = range(length - score_len, length)
                recall += FarRecall.measure(window, picks, model.cfg, scored=scored)
            # What the streaming loop scored, against what every length must score: the same final tokens.
            n = len(documents[i])
            if positions != range(n - score_len, n):
                raise AssertionError(
                    f"document {i}: length={length} scored positions {positions}, not {range(n - score_len, n)}, "
                    f"the final {score_len} tokens every length scores"
                )
        seconds = time.perf_counter() - t0
        tokens = len(chosen) * score_len
        rows.append(
            {
                "kind": "context",
                "length": length,
                "ppl": math.exp(total / tokens),
                "nll": total / tokens,
                "tokens": tokens,
                "documents": len(chosen),
                "seconds": round(seconds, 3),
                "tokens_per_s": round(len(chosen) * (length - 1) / seconds, 1),
                **(recall.metrics() if recall is not None else {}),
            }
        )
        log.info("ppl by context length=%d: %.3f (%d documents, %.1fs)", length, rows[-1]["ppl"], len(chosen), seconds)
    return rows


def document_ppl(
    model: CausalLM,
    documents: Sequence[np.ndarray],
    *,
    budget: StreamBudget = IN_RAM,
    progress: LabelledProgress | None = None,
    unit: str = "documents",
) -> dict:
    """Every predicted position of each whole document, streamed from its start: ``{"kind": "document", "ppl",
    "nll", "tokens", "documents", "seconds", "tokens_per_s"}``. ``progress`` is called with the label ``whole
    <unit>``, ``unit`` saying what the documents are (``windows`` when they are windows of the token stream): the
    pass streams each at its own length.

    Raises:
        ValueError: no document holds two tokens (nothing to predict).
    """
    chosen = [d for d in documents if len(d) >= 2]
    if not chosen:
        raise ValueError("document ppl: no document holds two tokens (nothing to predict)")
    streamed = sum(len(d) for d in chosen)
    on_tokens = progress(f"whole {unit}", streamed) if progress else None
    t0 = time.perf_counter()
    total, count = 0.0, 0
    for d in chosen:
        ids = torch.tensor(d, dtype=torch.long)[None]
        nll, m = window_nll(model, ids, budget=budget, on_tokens=on_tokens)
        total, count = total + nll, count + m
    seconds = time.perf_counter() - t0
    log.info("ppl of whole %s: %.3f (%d %s, %.1fs)", unit, math.exp(total / count), len(chosen), unit, seconds)
    return {
        "kind": "document",
        "ppl": math.exp(total / count),
        "nll": total / count,
        "tokens": count,
        "documents": len(chosen),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(streamed / seconds, 1),
    }

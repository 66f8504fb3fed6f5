"""Far recall: does the retriever fetch the chunk that holds an earlier occurrence of what comes next, when that
occurrence lies beyond the sliding windows' reach? A retrieval measurement on natural text, needing no needles.

For a token sequence ``x`` (chunks of ``S`` tokens, chunk ``j`` = positions ``[jS, (j+1)S)``), the model's
sliding-window reach ``W = (n_lower_layers + n_upper_layers) * window`` (``sliding_reach``) and an n-gram order
``n`` (default 4):

- A scored target ``x[t]`` is predicted from input position ``p = t - 1``, whose tokens read the retrieval row
  of landmark ``c - 1``, ``c = p // S`` (the row scored by chunk ``c - 1``'s landmark serves chunk ``c``); that
  row may pick among the ``V = c - 1`` visible chunks ``0 .. c - 2``, ``k = min(top_k, V)`` of them.
- ``x[t]`` *has a far occurrence* when the n-gram ``x[t-n+1 .. t]`` also ends at some ``e`` with ``p - e > W``
  (the whole earlier occurrence is out of ``p``'s sliding-window reach) in a visible chunk (``e // S <= c - 2``).
  Its target chunks are ``T_t = {e // S}`` over all such ``e``, ``m = |T_t| >= 1``.
- ``far_recall`` = the fraction of those targets whose row holds at least one chunk of ``T_t``;
  ``far_recall_random`` = their mean of ``1 - C(V - m, k) / C(V, k)``, the chance that ``k`` picks drawn uniformly
  without replacement from the ``V`` visible chunks hit ``T_t`` (``random_hit_rate``). Both average over the
  retrieval groups (each group's row is judged alike; ``far_recall_g<i>`` per group when there are several).
- ``far_recall_nearest`` = the same fraction for a fixed rule that reads nothing: the ``k`` visible chunks nearest
  to ``p`` among those that can hold a far occurrence (chunk ids ``<= min((p - W - 1) // S, c - 2)``, counting
  down; ``nearest_far_chunks``). Text repeats itself locally (code above all), so this recency rule is a much
  stronger baseline than uniform picks: a retriever that beats random but not it has learned "just beyond the
  window", not which chunk holds the repeat.

n-grams are matched exactly (``np.unique`` over the sliding windows), hit tests are binary searches, so a 64K-token
context costs milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model import GCAConfig
from model.retrieval import Picks

DEFAULT_NGRAM = 4


def sliding_reach(cfg: GCAConfig) -> int:
    """Tokens the sliding windows alone can carry information over: every layer of the decoder (lower and upper)
    attends ``window`` stream positions back, and ``window`` stream positions never span more than ``window``
    tokens (landmarks take positions too), so an occurrence farther back than this reaches a token only through
    retrieval."""
    return (cfg.n_lower_layers + cfg.n_upper_layers) * cfg.window


@dataclass(frozen=True)
class FarTargets:
    """The scored targets of one sequence that have a far occurrence (module docstring), in position order."""

    position: np.ndarray
    """``[M]`` target positions ``t``."""
    row: np.ndarray
    """``[M]`` query chunk id of the row serving ``t``: ``(t - 1) // S - 1``."""
    visible: np.ndarray
    """``[M]`` visible chunks ``V`` of that row."""
    chunks: np.ndarray
    """``[M]`` target chunks ``m``."""
    _gram: np.ndarray
    """``[M]`` n-gram id of ``t``."""
    _limit: np.ndarray
    """``[M]`` last end position an occurrence may have to count."""
    _first_key: np.ndarray
    """Sorted keys ``gram * n_chunks + chunk`` of every (n-gram, chunk) that holds the n-gram's end."""
    _first_end: np.ndarray
    """The earliest end position of that n-gram in that chunk, aligned with ``_first_key``."""
    _n_chunks: int

    def __len__(self) -> int:
        return len(self.position)

    def hits(self, picked: np.ndarray) -> np.ndarray:
        """``[M]`` bool: target ``i``'s picked chunk ids ``picked[i]`` (``[M, K]`` int, ``-1`` = no pick) include
        one of its target chunks."""
        picked = np.asarray(picked, dtype=np.int64)
        if not len(self) or not picked.size:
            return np.zeros(len(self), dtype=bool)
        key = self._gram[:, None] * self._n_chunks + np.clip(picked, 0, None)
        at = np.minimum(np.searchsorted(self._first_key, key), len(self._first_key) - 1)
        found = (self._first_key[at] == key) & (picked >= 0)
        return (found & (self._first_end[at] <= self._limit[:, None])).any(1)


def far_targets(
    tokens: np.ndarray, *, chunk_size: int, reach: int, n: int = DEFAULT_NGRAM, scored: range | None = None
) -> FarTargets:
    """The far-occurrence targets of ``tokens [N]`` (module docstring) among the target positions ``scored``
    (default: every predicted position, ``range(1, N)``, what the LM loss scores).

    Raises:
        ValueError: ``n < 1``, ``chunk_size < 1``, ``reach < 0``, or ``scored`` outside ``[1, N)``.
    """
    tokens = np.asarray(tokens).reshape(-1)
    N = len(tokens)
    if n < 1 or chunk_size < 1 or reach < 0:
        raise ValueError(f"far_targets: need n >= 1, chunk_size >= 1, reach >= 0; got {n}, {chunk_size}, {reach}")
    scored = range(1, N) if scored is None else scored
    if len(scored) and (scored.step != 1 or scored.start < 1 or scored.stop > N):
        raise ValueError(f"far_targets: scored={scored} must be a step-1 range inside [1, {N})")
    n_chunks = -(-N // chunk_size)
    ends = np.arange(n - 1, N)  # positions where an n-gram ends
    empty = np.zeros(0, dtype=np.int64)
    if not len(ends):
        return FarTargets(empty, empty, empty, empty, empty, empty, empty, empty, n_chunks)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, n)  # [N - n + 1, n], row i ends at i + n - 1
    gram = np.unique(windows, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    # Occurrences sorted by (n-gram, end position): each n-gram's ends form one ascending run.
    order = np.lexsort((ends, gram))
    sorted_gram, sorted_end = gram[order], ends[order]
    sorted_key = sorted_gram * N + sorted_end
    sorted_chunk = sorted_end // chunk_size
    new_chunk = np.ones(len(order), dtype=bool)
    new_chunk[1:] = (sorted_gram[1:] != sorted_gram[:-1]) | (sorted_chunk[1:] != sorted_chunk[:-1])
    # Distinct (n-gram, chunk) pairs up to and including each occurrence; a run's first occurrence always opens a
    # pair, so the pairs of one n-gram up to an occurrence are this count minus the count before its run.
    distinct = np.cumsum(new_chunk)

    t = np.arange(max(scored.start, n - 1), scored.stop) if len(scored) else empty
    c = (t - 1) // chunk_size
    limit = np.minimum(t - 2 - reach, (c - 1) * chunk_size - 1)  # p - e > reach and e // S <= c - 2
    g = gram[t - (n - 1)]
    first_of_run = np.searchsorted(sorted_gram, g, side="left")
    last = np.searchsorted(sorted_key, g * N + limit, side="right") - 1  # last occurrence with e <= limit
    qualifies = (c >= 2) & (last >= first_of_run)
    t, c, limit, g, first_of_run, last = (a[qualifies] for a in (t, c, limit, g, first_of_run, last))
    before_run = np.where(first_of_run > 0, distinct[np.maximum(first_of_run - 1, 0)], 0)
    return FarTargets(
        position=t,
        row=c - 1,
        visible=c - 1,
        chunks=distinct[last] - before_run,
        _gram=g,
        _limit=limit,
        _first_key=sorted_gram[new_chunk] * n_chunks + sorted_chunk[new_chunk],
        _first_end=sorted_end[new_chunk],
        _n_chunks=n_chunks,
    )


def nearest_far_chunks(targets: FarTargets, *, chunk_size: int, reach: int, top_k: int) -> np.ndarray:
    """``[M, top_k]`` the recency rule's picks for each target (module docstring): the ``top_k`` nearest visible
    chunks that lie wholly or partly beyond the sliding reach of the target's input position, ``-1`` past chunk 0."""
    p = targets.position - 1
    nearest = np.minimum((p - reach - 1) // chunk_size, targets.visible - 1)
    picks = nearest[:, None] - np.arange(top_k)[None, :]
    return np.where(picks >= 0, picks, -1)


def random_hit_rate(visible: np.ndarray, chunks: np.ndarray, top_k: int) -> np.ndarray:
    """``1 - C(V - m, k) / C(V, k)`` with ``k = min(top_k, V)``: the chance that ``k`` chunks drawn uniformly without
    replacement among ``V`` visible ones include at least one of ``m`` target chunks (``1 <= m <= V``).

    The ratio is the product ``prod_{i<k} (V - m - i) / (V - i)``; its first factor at or below zero (``V - m < k``:
    the picks cannot all miss) makes it 0."""
    V = np.asarray(visible, dtype=np.float64)
    m = np.asarray(chunks, dtype=np.float64)
    k = np.minimum(top_k, V)
    miss = np.ones_like(V)
    for i in range(top_k):
        factor = np.where(i < k, np.clip(V - m - i, 0, None) / np.maximum(V - i, 1), 1.0)
        miss = miss * factor
    return 1.0 - miss


def picked_chunks(picks: Picks, group: int, rows: np.ndarray, batch_row: int, top_k: int) -> np.ndarray:
    """``[len(rows), top_k]`` the chunk ids group ``group``'s rows ``rows`` (query chunk ids) picked for batch row
    ``batch_row``, ``-1`` where a row picked fewer (the first chunks).

    Raises:
        KeyError: a row was not recorded (naming it): the forward never scored it, a bookkeeping bug.
    """
    out = np.full((len(rows), top_k), -1, dtype=np.int64)
    for i, row in enumerate(rows.tolist()):
        if (group, row) not in picks:
            raise KeyError(f"far recall: group {group}'s retrieval row of chunk {row} was not recorded")
        chosen = picks[(group, row)][batch_row]
        out[i, : len(chosen)] = chosen
    return out


@dataclass
class FarRecall:
    """Sums behind far recall over any number of sequences; add them with ``+``, read them with ``metrics``."""

    tokens: int = 0
    """Targets with a far occurrence."""
    random: float = 0.0
    """Sum of their ``random_hit_rate``."""
    nearest: int = 0
    """Targets the recency rule (``nearest_far_chunks``) would have served."""
    hits: list[int] = field(default_factory=list)
    """Per retrieval group: targets whose row held a target chunk."""

    @staticmethod
    def measure(
        tokens: np.ndarray,
        picks: Picks,
        cfg: GCAConfig,
        *,
        batch_row: int = 0,
        scored: range | None = None,
        n: int = DEFAULT_NGRAM,
    ) -> FarRecall:
        """Far recall of one sequence ``tokens`` (positions counted from the start of the recorded forward or stream,
        which numbers the chunks) from the retrievals ``picks`` recorded for it (``GCAForCausalLM.picks`` or
        ``StreamState.picks``), batch row ``batch_row``; ``scored`` as in ``far_targets``."""
        reach = sliding_reach(cfg)
        targets = far_targets(tokens, chunk_size=cfg.chunk_size, reach=reach, n=n, scored=scored)
        hits = [
            int(targets.hits(picked_chunks(picks, g, targets.row, batch_row, cfg.top_k)).sum())
            for g in range(len(cfg.groups))
        ]
        random = float(random_hit_rate(targets.visible, targets.chunks, cfg.top_k).sum())
        nearest = nearest_far_chunks(targets, chunk_size=cfg.chunk_size, reach=reach, top_k=cfg.top_k)
        return FarRecall(tokens=len(targets), random=random, nearest=int(targets.hits(nearest).sum()), hits=hits)

    @staticmethod
    def empty(n_groups: int) -> FarRecall:
        """Nothing measured yet, for a model with ``n_groups`` retrieval groups (the start of a sum)."""
        return FarRecall(hits=[0] * n_groups)

    def __add__(self, other: FarRecall) -> FarRecall:
        if len(self.hits) != len(other.hits):
            raise ValueError(f"far recall of {len(self.hits)} and {len(other.hits)} retrieval groups do not add up")
        return FarRecall(
            self.tokens + other.tokens,
            self.random + other.random,
            self.nearest + other.nearest,
            [a + b for a, b in zip(self.hits, other.hits)],
        )

    def as_sums(self) -> list[float]:
        """``[tokens, random, nearest, *hits]``: what ranks sum (``from_sums`` reads it back)."""
        return [float(self.tokens), self.random, float(self.nearest), *map(float, self.hits)]

    @staticmethod
    def from_sums(sums: Sequence[float]) -> FarRecall:
        return FarRecall(round(sums[0]), float(sums[1]), round(sums[2]), [round(h) for h in sums[3:]])

    def metrics(self, prefix: str = "") -> dict[str, float | int | None]:
        """``{prefix}far_recall``, ``{prefix}far_recall_random``, ``{prefix}far_recall_nearest`` (each None when no
        target qualified), ``{prefix}far_recall_tokens`` and, with several groups, ``{prefix}far_recall_g<i>``."""
        out: dict[str, float | int | None] = {}
        qualified = self.tokens > 0 and bool(self.hits)
        out[f"{prefix}far_recall"] = sum(self.hits) / (len(self.hits) * self.tokens) if qualified else None
        out[f"{prefix}far_recall_random"] = self.random / self.tokens if self.tokens else None
        out[f"{prefix}far_recall_nearest"] = self.nearest / self.tokens if self.tokens else None
        out[f"{prefix}far_recall_tokens"] = self.tokens
        if len(self.hits) > 1:
            for g, h in enumerate(self.hits):
                out[f"{prefix}far_recall_g{g}"] = h / self.tokens if self.tokens else None
        return out


def shown_with_counts(values: Mapping[str, Any]) -> str:
    """``key=value`` pairs as the logs print them (floats to 4 significant digits), every far-recall rate followed by
    the count it is a fraction of, ``far_recall=0.5 (n=2)``: a rate of 2 tokens is no rate of 2,000. The count is
    ``far_recall_tokens`` under the rate's prefix (``retrieval/``)."""
    parts = []
    for key, value in values.items():
        text = f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        prefix, found, rest = key.rpartition("far_recall")
        count = f"{prefix}far_recall_tokens"
        if found and rest != "_tokens" and count in values:
            text += f" (n={values[count]})"
        parts.append(text)
    return " ".join(parts)

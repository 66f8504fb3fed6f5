"""Weighted data mixtures: one global training stream drawn from several sources in declared token shares.

A *source* is a prepared dataset's training split (optionally only its documents within a length bucket), or the
synthetic retrieval tasks, which are written over sequences of a *host* text source. Every source's sequences have
``seq_len`` tokens, so a share of the sequences is a share of the training tokens.

Which source global sequence ``i`` comes from is a pure function of the weights and ``i`` (`Schedule`): within a
*phase* (a step range with its own weights) the sources take turns by earliest deadline first over their Pfair
windows: the ``k``-th sequence of a source of weight ``w`` (``k`` = 1, 2, ... within the phase) is placed at a
position ``p`` of the phase with ``floor((k - 1) / w) <= p < ceil(k / w)``. Since the weights sum to 1 that schedule
always exists, and it keeps every prefix of the phase within one sequence of ``w * n`` for every source
(Baruah et al., "Proportionate progress", 1996): the stratified mix every global batch reflects, with no random draw
at the mix level. The weights are exact multiples of 2**-16 (`exact_weights`), so the schedule is the same on every
machine.

Each text source reads its own split in its own order (``pipeline.data.order``, seeded per source), one sequence
each time the schedule names it or a retrieval source it hosts; a new phase continues each source where it stopped,
so a change of weights neither repeats nor skips a document. The state is the number of sequences drawn and each
text source's own state: the ranks each read the whole global batch (``RankBatches`` takes its slice), so it resumes
exactly on any number of ranks.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from pipeline.data.reader import SourceStream

RESOLUTION = 1 << 16
"""Weights are whole multiples of ``1 / RESOLUTION``: the schedule repeats every ``RESOLUTION`` sequences at most."""
MIXTURE_STATE_KEY = "mixture"
"""Where a data state of several text sources records the mixture (`MixtureStream.state_dict`)."""
READ_AHEAD_TOKENS = 1 << 18
"""A mixture of several text sources draws at least this many tokens' sequences at a time (a whole number of
requests, at least one): each source's stream is then called once per 256K tokens instead of once per step, where
its fixed cost (some microseconds per source) was a fifth of reading a step of 16 x 1K tokens. Memory: one global
batch, or this many tokens when a batch is smaller, in the sources' token dtype (512 KiB of uint16)."""


def exact_weights(weights: Sequence[float]) -> tuple[Fraction, ...]:
    """``weights`` (finite, >= 0, some > 0) normalised to exact fractions of `RESOLUTION` that sum to 1: each the
    nearest multiple of ``1 / RESOLUTION`` by the largest-remainder rule (so within ``1 / RESOLUTION`` of the
    normalised value), and a weight above 0 never below ``1 / RESOLUTION``."""
    total = sum(weights)
    scaled = [w / total * RESOLUTION for w in weights]
    units = [max(math.floor(x), 1) if w > 0 else 0 for w, x in zip(weights, scaled)]
    by_remainder = sorted(range(len(units)), key=lambda i: (units[i] - scaled[i], i))
    step = 1 if sum(units) < RESOLUTION else -1
    for i in itertools.cycle(by_remainder if step == 1 else reversed(by_remainder)):
        if sum(units) == RESOLUTION:
            break
        if step == 1 or units[i] > 1:
            units[i] += step
    return tuple(Fraction(u, RESOLUTION) for u in units)


def interleave(weights: Sequence[Fraction], n: int) -> np.ndarray:
    """The source of each of the first ``n`` positions of a phase of ``weights`` (`PhaseOrder`)."""
    return PhaseOrder(weights).slice(0, n)


def earliest_deadline_first(weights: Sequence[Fraction], n: int) -> np.ndarray:
    """The sources of ``n`` positions, by earliest deadline first over the sources' Pfair windows (module
    docstring): the ``k``-th sequence of a source of weight ``w = p / q`` is released at ``floor((k - 1) q / p)`` and
    due by ``ceil(k q / p)``. ``weights`` sum to 1; a source of weight 0 is never chosen."""
    out = np.empty(n, dtype=np.int16)
    counts = [0] * len(weights)
    numerators, denominators = [w.numerator for w in weights], [w.denominator for w in weights]

    def window(source: int) -> tuple[int, int]:
        p, q, c = numerators[source], denominators[source], counts[source]
        return (c * q) // p, -((-(c + 1) * q) // p)

    waiting = [(*window(source), source) for source, w in enumerate(weights) if w > 0]  # (release, deadline, source)
    heapq.heapify(waiting)
    ready: list[tuple[int, int]] = []  # (deadline, source)
    for position in range(n):
        while waiting and waiting[0][0] <= position:
            _, deadline, source = heapq.heappop(waiting)
            heapq.heappush(ready, (deadline, source))
        # Weights summing to 1 keep a released sequence waiting at every position; the fallback guards rounding.
        _, source = heapq.heappop(ready) if ready else heapq.heappop(waiting)[1:]
        out[position] = source
        counts[source] += 1
        heapq.heappush(waiting, (*window(source), source))
    return out


class PhaseOrder:
    """The source of each position of one phase (`earliest_deadline_first`), held as one period.

    The schedule repeats with a period of the least common multiple ``L`` of the weights' denominators (at most
    `RESOLUTION`): after ``L`` positions every source has exactly ``w * L`` sequences (within one, and both are
    integers), so every window and choice afterwards is the first period's shifted by ``L``. The first period is
    scheduled when the order is made (at most `RESOLUTION` positions, about 0.1 s); any position is then a lookup.

    Raises:
        ValueError: weights that are not multiples of ``1 / RESOLUTION`` summing to 1 (not from `exact_weights`).
    """

    def __init__(self, weights: Sequence[Fraction]) -> None:
        length = math.lcm(*(w.denominator for w in weights))
        if RESOLUTION % length or sum(weights) != 1:
            raise ValueError(f"weights {tuple(weights)} are not multiples of 1/{RESOLUTION} summing to 1")
        self.period = earliest_deadline_first(weights, length)
        self.period_counts = np.bincount(self.period, minlength=len(weights)).astype(np.int64)

    def slice(self, offset: int, n: int) -> np.ndarray:
        """The sources of positions ``[offset, offset + n)`` of the phase."""
        first = offset % len(self.period)
        if first + n <= len(self.period):
            return self.period[first : first + n]
        return self.period[np.arange(first, first + n) % len(self.period)]

    def counts(self, n: int) -> np.ndarray:
        """Sequences each source gives among the phase's first ``n`` positions."""
        whole, rest = divmod(n, len(self.period))
        partial = np.bincount(self.period[:rest], minlength=len(self.period_counts))
        return whole * self.period_counts + partial


@dataclass(frozen=True)
class Phase:
    """The weights from global sequence ``start`` on (until the next phase's start)."""

    start: int
    weights: tuple[Fraction, ...]


class Schedule:
    """The source of every global sequence index under ``phases`` (the first starts at 0); memory: one period per
    phase."""

    def __init__(self, phases: Sequence[Phase]) -> None:
        if not phases or phases[0].start != 0 or any(a.start >= b.start for a, b in zip(phases, phases[1:])):
            raise ValueError("the phases must start at sequence 0 and in increasing order")
        self.phases = list(phases)
        self._orders = [PhaseOrder(phase.weights) for phase in self.phases]
        self._ends = [after.start for after in self.phases[1:]] + [None]

    def _overlaps(self, start: int, end: int):
        """Each phase's part of ``[start, end)``: (order, first position in the phase, global first, global end)."""
        for phase, order, phase_end in zip(self.phases, self._orders, self._ends):
            lo, hi = max(start, phase.start), end if phase_end is None else min(end, phase_end)
            if lo < hi:
                yield order, lo - phase.start, lo, hi

    def range(self, start: int, n: int) -> np.ndarray:
        """The sources of global sequences ``[start, start + n)`` (int64)."""
        out = np.empty(n, dtype=np.int64)
        for order, offset, lo, hi in self._overlaps(start, start + n):
            out[lo - start : hi - start] = order.slice(offset, hi - lo)
        return out

    def counts(self, end: int, num_sources: int) -> np.ndarray:
        """Sequences each source gives among global indices ``[0, end)``."""
        total = np.zeros(num_sources, dtype=np.int64)
        for order, _, lo, hi in self._overlaps(0, end):
            total += order.counts(hi - lo)
        return total


@dataclass(frozen=True)
class Source:
    """One source as the stream uses it."""

    label: str
    task: Literal["text", "retrieval"]
    host: int
    """The text source whose stream gives this source's sequences (a text source: itself)."""


@dataclass
class Draw:
    """What `MixtureStream.next_labeled` returns for ``n`` global sequences."""

    sequences: np.ndarray
    """``[n, seq_len]`` in the sources' token dtype (uint16 or uint32 as data prep wrote them; int64 from the
    window order): widening them is left to whoever copies them anyway (``RankBatches``)."""
    keys: np.ndarray
    """Each sequence's id in its text source's stream: what a retrieval task's random draws are keyed on."""
    sources: np.ndarray
    """Each sequence's source index."""
    tasks: np.ndarray
    """Whether each sequence gets a retrieval task written over it."""

    def part(self, lo: int, hi: int) -> Draw:
        """Sequences ``[lo, hi)`` of this draw (views)."""
        return Draw(self.sequences[lo:hi], self.keys[lo:hi], self.sources[lo:hi], self.tasks[lo:hi])

    @staticmethod
    def joined(parts: Sequence[Draw]) -> Draw:
        fields = ("sequences", "keys", "sources", "tasks")
        return Draw(*(np.concatenate([getattr(part, field) for part in parts]) for field in fields))


@dataclass
class _Ahead:
    """The sequences a mixture of several text sources has drawn ahead of its position (`READ_AHEAD_TOKENS`)."""

    start: int
    """The global index of the first."""
    draw: Draw
    epochs: np.ndarray | None
    """``[sequences, text sources]``: each text source's epoch as of each sequence (that of its last one so far);
    None when no source began an epoch within these sequences."""
    epochs_after: dict[str, int]
    """Each text source's epoch after the last of them, by label."""
    anchor: dict[str, dict[str, Any]]
    """Each text source's state before the first, by label: what a checkpoint records while the position is inside."""

    @property
    def end(self) -> int:
        return self.start + len(self.draw.keys)


class MixtureStream:
    """The global training stream of a mixture (module docstring).

    Args:
        sources: every source, in the order of the schedule's indices.
        streams: the stream of each text source, by index.
        schedule: the source of each global sequence.
        record: what a checkpoint records of the mixture and a resume compares (`check_mixture_resume`); None for
            a mixture of one text source, whose state is that stream's own (a checkpoint from before mixtures
            resumes, and this one resumes there).
    """

    def __init__(
        self,
        sources: Sequence[Source],
        streams: Mapping[int, SourceStream],
        schedule: Schedule,
        record: dict[str, Any] | None,
    ) -> None:
        self.sources, self.streams, self.schedule, self.record = list(sources), dict(streams), schedule, record
        self.consumed = 0
        """Global sequences drawn: the index of the next one."""
        self._host_of = np.asarray([s.host for s in self.sources], dtype=np.int64)
        self._task_of = np.asarray([s.task == "retrieval" for s in self.sources])
        self._ordered = sorted(self.streams.items())
        self._labels = [self.sources[index].label for index, _ in self._ordered]
        """Each text source's label, in `_ordered`'s order."""
        self._seq_len = self._ordered[0][1].seq_len
        self._ahead: _Ahead | None = None
        self._drawn = 0
        """The global index the text streams have read up to (several text sources)."""

    @property
    def epoch(self) -> int:
        """The highest epoch any text source has reached (0-based)."""
        return max(self.epochs().values())

    def epochs(self) -> dict[str, int]:
        """Each text source's epoch (that of its last sequence drawn), by label."""
        ahead = self._ahead
        if ahead is None or self.consumed == ahead.start:
            return {label: stream.epoch for label, (_, stream) in zip(self._labels, self._ordered)}
        if ahead.epochs is None:
            return dict(ahead.epochs_after)
        row = ahead.epochs[self.consumed - 1 - ahead.start]
        return {label: int(epoch) for label, epoch in zip(self._labels, row)}

    def next_labeled(self, n: int) -> Draw:
        if len(self.streams) == 1:  # every sequence is the one text stream's next
            sources = self.schedule.range(self.consumed, n)
            self.consumed += n
            (stream,) = self.streams.values()
            alone = np.empty((n, self._seq_len), dtype=stream.token_dtype)
            alone_keys, _ = stream.fill(alone, None)
            return Draw(sequences=alone, keys=alone_keys, sources=sources, tasks=self._task_of[sources])
        parts = []
        while n > 0:
            if self._ahead is None or self.consumed >= self._ahead.end:
                self._read_ahead(n)
            assert self._ahead is not None
            lo = self.consumed - self._ahead.start
            take = min(n, self._ahead.end - self.consumed)
            parts.append(self._ahead.draw.part(lo, lo + take))
            self.consumed, n = self.consumed + take, n - take
        return parts[0] if len(parts) == 1 else Draw.joined(parts)

    def _read_ahead(self, n: int) -> None:
        """Draw the sequences from where the text streams stand (at or before the position) to at least ``n``
        past the position, `READ_AHEAD_TOKENS` at least, each source writing straight into the global rows."""
        start = self._drawn
        size = max(n * max(1, READ_AHEAD_TOKENS // (n * self._seq_len)), self.consumed - start + n)
        anchor = {label: stream.state_dict() for label, (_, stream) in zip(self._labels, self._ordered)}
        sources = self.schedule.range(start, size)
        hosts = self._host_of[sources]
        by_host = np.argsort(hosts, kind="stable")  # each text source's rows, in order
        ends = np.cumsum(np.bincount(hosts, minlength=len(self.sources)))
        dtype = np.result_type(*(stream.token_dtype for _, stream in self._ordered))
        sequences = np.empty((size, self._seq_len), dtype=dtype)
        keys = np.empty(size, dtype=np.int64)
        before = [stream.epoch for _, stream in self._ordered]
        filled = []
        for index, stream in self._ordered:
            rows = by_host[ends[index - 1] if index else 0 : ends[index]]
            if len(rows):
                keys[rows], row_epochs = stream.fill(sequences, rows)
                filled.append((rows, row_epochs))
            else:
                filled.append((rows, rows))
        after = [stream.epoch for _, stream in self._ordered]
        epochs = None
        if before != after:  # a source began an epoch here (rare): each one's epoch as of every row
            epochs = np.empty((size, len(self._ordered)), dtype=np.int64)
            for j, (rows, row_epochs) in enumerate(filled):
                column = np.full(size, before[j], dtype=np.int64)  # before its first row here: its last one's
                column[rows] = row_epochs
                epochs[:, j] = np.maximum.accumulate(column)
        draw = Draw(sequences=sequences, keys=keys, sources=sources, tasks=self._task_of[sources])
        self._ahead = _Ahead(start, draw, epochs, dict(zip(self._labels, after)), anchor)
        self._drawn = start + size

    def next(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        draw = self.next_labeled(n)
        return draw.sequences, draw.keys

    def state_dict(self) -> dict[str, Any]:
        if self.record is None:
            (stream,) = self.streams.values()
            return {**stream.state_dict(), "mixture_consumed": self.consumed}
        ahead = self._ahead
        if ahead is not None and self.consumed < ahead.end:  # the streams have read past the position
            streams, at = ahead.anchor, ahead.start
        else:
            streams = {label: stream.state_dict() for label, (_, stream) in zip(self._labels, self._ordered)}
            at = self._drawn
        return {MIXTURE_STATE_KEY: {**self.record, "consumed": self.consumed, "streams_at": at, "streams": streams}}

    def check_resume(self, state: dict[str, Any]) -> None:
        """Whether the data state ``state`` of a checkpoint can continue in this mixture.

        Raises:
            MixtureResumeError: one line: one side declares ``data.sources`` and the other not, or
                `check_mixture_resume` refuses the change.
        """
        saved = state.get(MIXTURE_STATE_KEY)
        if self.record is None and saved is not None:
            raise MixtureResumeError(
                "the checkpoint was written by a run with data.sources (a mixture); set the same data.sources "
                "to resume it"
            )
        if self.record is not None and saved is None:
            raise MixtureResumeError(
                "the checkpoint was written by a run of one dataset (data.path); a mixture (data.sources) cannot "
                "continue its position: start a new run from its weights (checkpoint.init_from)"
            )
        if saved is not None and self.record is not None:
            check_mixture_resume(saved, self.record, int(saved["consumed"]))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_resume(state)
        if self.record is None:
            (stream,) = self.streams.values()
            stream.load_state_dict(state)
            self.consumed = int(state["mixture_consumed"]) if "mixture_consumed" in state else _consumed_of(state)
            return
        saved = state[MIXTURE_STATE_KEY]
        for index, stream in self.streams.items():
            label = self.sources[index].label
            if label in saved["streams"]:
                stream.load_state_dict(saved["streams"][label])
        self.consumed = int(saved["consumed"])
        # Where the recorded stream states stand: the first draw reads from there and skips to the position.
        self._drawn, self._ahead = int(saved.get("streams_at", self.consumed)), None


def _consumed_of(state: dict[str, Any]) -> int:
    """Global sequences drawn, from the state of a single stream written before mixtures (blocks or window
    order), where every global sequence was the stream's next."""
    if "consumed" in state:
        return int(state["consumed"])
    return int(state["window_index"]) * int(state["window"]) + int(state["taken"])


class MixtureResumeError(ValueError):
    """A checkpoint's mixture cannot continue under this config; the message names the key."""


def with_tasks(stream: SourceStream, fraction: float, label: str = "data") -> MixtureStream:
    """One text stream with the retrieval tasks over ``fraction`` of its sequences: the mixture ``data.path`` with
    ``data.retrieval_mix.fraction`` makes (``pipeline.train.sources``), for a stream built by hand."""
    sources = [Source(label, "text", 0), Source("retrieval", "retrieval", 0)]
    return MixtureStream(sources, {0: stream}, Schedule([Phase(0, exact_weights([1 - fraction, fraction]))]), None)


def check_mixture_resume(saved: dict[str, Any], current: dict[str, Any], consumed: int) -> None:
    """Refuse to continue a mixture whose past or current phases changed, ``consumed`` global sequences in.

    ``saved`` and ``current`` are `MixtureStream` records: ``sources`` (label -> definition, fingerprint included)
    and ``phases`` (list of ``{"start": first global sequence, "weights": {label: "p/q"}}``). A phase that starts
    at or after ``consumed`` may be added, changed or removed; a source may be added when no past or current phase
    gives it a weight.

    Raises:
        MixtureResumeError: one line naming what changed.
    """
    old_phases, new_phases = saved["phases"], current["phases"]
    # A phase has drawn from the stream once it starts before the position; one starting at it has drawn nothing.
    reached_old = [p for p in old_phases if p["start"] < consumed or p["start"] == 0]
    reached_new = [p for p in new_phases if p["start"] < consumed or p["start"] == 0]
    if len(reached_old) != len(reached_new):
        raise MixtureResumeError(
            f"the checkpoint is in phase {len(reached_old) - 1} of data.phases (started at sequence "
            f"{reached_old[-1]['start']}), the config puts sequence {consumed} in phase {len(reached_new) - 1}: a "
            "past or current phase cannot be added, moved or removed"
        )
    for number, (old, new) in enumerate(zip(reached_old, reached_new)):
        key = "data.sources[*].weight" if number == 0 else f"data.phases[{number - 1}]"
        if old["start"] != new["start"]:
            raise MixtureResumeError(
                f"{key}: a past or current phase moved (starts at sequence {old['start']} in the checkpoint, "
                f"{new['start']} now)"
            )
        if old["weights"] != new["weights"]:
            raise MixtureResumeError(
                f"{key}: the weights of a past or current phase changed ({_shown(old['weights'])} in the checkpoint, "
                f"{_shown(new['weights'])} now); add a later phase instead"
            )
    used = {label for p in reached_old for label, w in p["weights"].items() if Fraction(w) > 0}
    for label in sorted(used):
        if label not in current["sources"]:
            raise MixtureResumeError(f"data.sources: the source {label!r} the checkpoint drew from is gone")
        if saved["sources"][label] != current["sources"][label]:
            changed = sorted(
                k
                for k in {*saved["sources"][label], *current["sources"][label]}
                if saved["sources"][label].get(k) != current["sources"][label].get(k)
            )
            raise MixtureResumeError(
                f"data.sources: the source {label!r} changed since the checkpoint ({', '.join(changed)}); its "
                "position means nothing in other data"
            )


def _shown(weights: Mapping[str, str]) -> str:
    return ", ".join(f"{label}={float(Fraction(w)):.6g}" for label, w in weights.items())


def phase_record(phase: Phase, labels: Sequence[str]) -> dict[str, Any]:
    """A phase as a checkpoint records it: its start and its nonzero weights as exact fractions."""
    return {
        "start": phase.start,
        "weights": {label: str(w) for label, w in zip(labels, phase.weights) if w > 0},
    }

"""Passkey / needle-in-a-haystack retrieval, laid out on the model's chunks (docs/evaluation.md).

A sample of ``length`` tokens is a haystack window with the needle(s), the question and the answer written over
it, laid out on the model's chunks by the trainer's own needle layout (``pipeline.data.needle``): the
question's last token is the first token of a chunk near the end (so the answer is predicted by a chunk whose
retrieval the question's landmark triggered), and the key-bearing needle starts at
``round(depth * room)`` (``room`` = latest start before the question), moved left by less than a chunk if it
would straddle two chunks. Depth 0 is the start, depth 1 right before the question. Other needles (distractors,
hop links) go at seeded random free spots. Everything is seeded per (seed, length, depth, sample).

Scoring: the input stops right before the answer, so no answer token is ever in the input before it is
predicted; the model then decodes greedily, feeding back its *own* predictions. ``accuracy`` = the first answer
token is right; ``exact_match`` = all answer tokens are. Leading answer tokens that are pure whitespace (e.g. the
space before the digits) are moved into the question: they are the same for every key and would make the first
token trivially predictable.

Variants: every family of ``pipeline.data.retrieval_tasks`` (``single``, ``multikey``, ``multivalue``,
``multiquery``, ``vt``, ``multihop``), built by the function that builds the trainer's retrieval mix, so what is
trained and what is evaluated cannot drift. ``single``, ``multikey`` and ``multihop`` take templates
(``needle``, ``question``, ``answer``, ``link``); ``multihop`` needs >= 2 retrieval groups in GCA, as its
question names only the chain's start.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model import CausalLM
from pipeline.data.needle import NeedleSpec
from pipeline.data.retrieval_tasks import AGGREGATION_FAMILIES, Codec, TaskSample, TaskShape, build_task
from pipeline.evaluation.generate import decode, prefill
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.resume import SampleLog
from pipeline.evaluation.runtime import IN_RAM, StreamBudget, stream_state
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PasskeyGrid:
    """What a passkey run asks: ``samples`` samples of ``spec`` per (length, depth), seeded per
    (seed, length, depth, sample)."""

    spec: NeedleSpec
    lengths: list[int]
    depths: list[float]
    samples: int
    seed: int


def build_sample(
    source: TokenSource,
    tokenizer: ModelTokenizer | ByteTokenizer,
    spec: NeedleSpec,
    *,
    length: int,
    depth: float | None,
    rng: np.random.Generator,
    chunk_size: int,
    shape: TaskShape | None = None,
) -> TaskSample:
    """One sample of family ``spec.variant`` over a haystack window of ``length`` tokens drawn from ``source``,
    built by the trainer's own builder (``pipeline.data.retrieval_tasks.build_task``); ``depth`` ``None``: drawn
    from ``rng``; ``shape``: the counts (default: ``spec``'s, ``task_shape``).

    Raises:
        ValueError: ``length`` cannot hold the needles, question and answer; a template is malformed.
    """
    window = source.window(length, rng).astype(np.int64)  # overwritten by needles, question and answer
    return build_task(
        spec.variant,
        window,
        Codec(tokenizer.encode, tokenizer.decode),
        rng,
        chunk_size=chunk_size,
        shape=shape or task_shape(spec),
        spec=spec,
        depth=depth,
    )


def task_shape(spec: NeedleSpec) -> TaskShape:
    """The counts of ``spec`` as the builder takes them (multihop: ``needles // 2`` chains of two needles)."""
    chains = spec.needles // 2 if spec.variant == "multihop" else spec.chains
    return TaskShape(
        needles=spec.needles,
        values=spec.values,
        queries=spec.queries,
        hops=spec.hops,
        chains=chains,
        key_digits=spec.key_digits,
        value_kind=spec.value_kind,
    )


def predict_answer(
    model: CausalLM,
    sample: TaskSample,
    *,
    budget: StreamBudget = IN_RAM,
    on_tokens: Callable[[int], None] | None = None,
    picks: dict[tuple[int, int], list[list[int]]] | None = None,
) -> list[int]:
    """Greedy prediction of the answer tokens: stream ``ids[:answer_start]``, then feed back own predictions.

    All but the last ``model.window_reach`` prefix tokens are streamed with ``memory_only`` (same predictions:
    the answer is beyond the reach of the skipped layers; a GCA model still reads every chunk of the prefix).
    ``picks``: filled with the retrievals scored (``StreamState.picks``).
    """
    device = next(model.parameters()).device
    prefix = torch.from_numpy(sample.ids[: sample.answer_start])[None].to(device)
    with stream_state(model, budget) as state:
        state.picks = picks
        last = prefill(model, state, prefix, budget.segment, on_tokens, skip_far_layers=True)
        return list(decode(model, state, last, sample.answer_len, on_tokens=on_tokens))


def evaluate_passkey(
    model: CausalLM,
    tokenizer: ModelTokenizer | ByteTokenizer,
    source: TokenSource,
    grid: PasskeyGrid,
    *,
    budget: StreamBudget = IN_RAM,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
    finished: SampleLog | None = None,
) -> list[dict]:
    """Rows ``{"length", "depth", "accuracy", "exact_match", "n", "seconds", "seconds_per_sample",
    "tokens_per_s", "tokens_per_s_at"}`` per (length, depth) (``tokens_per_s_at``: ``SpeedByPosition``). Samples
    are laid out on the chunks of ``model`` (``model.cfg.chunk_size``).

    ``finished``: samples it holds are taken from it instead of being run, and every sample run is added to it as
    it finishes (a killed run continues from there). ``progress(length, tokens)`` gets the tokens still to stream
    at that length (its samples' ``length`` tokens each, the finished ones left out).
    """
    rows = []
    samples = grid.samples
    for length in grid.lengths:
        keys = [(length, d, depth, s) for d, depth in enumerate(grid.depths) for s in range(samples)]
        todo = sum(finished is None or finished.get(key) is None for key in keys)
        if finished is not None and todo < len(keys):
            log.info(
                "passkey length=%d: %d of %d samples finished earlier (%s), skipping them",
                length,
                len(keys) - todo,
                len(keys),
                finished.path,
            )
        on_tokens = progress(length, todo * length) if progress and todo else None
        for d, depth in enumerate(grid.depths):
            records = []
            for s in range(samples):
                record = finished.get((length, d, depth, s)) if finished else None
                if record is None:
                    where = _SampleAt(length=length, depth_index=d, depth=depth, sample=s)
                    record = _run_sample(model, tokenizer, source, grid, where, budget=budget, on_tokens=on_tokens)
                    if finished is not None:
                        finished.add(record)
                records.append(record)
            hits = sum(r["predicted"][:1] == r["answer"][:1] for r in records)
            exact = sum(r["predicted"] == r["answer"] for r in records)
            seconds = sum(r["seconds"] for r in records)
            rows.append(
                {
                    "length": length,
                    "depth": depth,
                    "accuracy": hits / samples,
                    "exact_match": exact / samples,
                    "n": samples,
                    "seconds": round(seconds, 3),
                    "seconds_per_sample": round(seconds / samples, 3),
                    # Records keep seconds to 1 ms, so a sample faster than that (a stub model) counts as 1 ms.
                    "tokens_per_s": round(samples * length / max(seconds, 1e-3), 1),
                    "tokens_per_s_at": _mean_speeds(records),
                    **({"retrieval": retrieval} if (retrieval := count_retrievals(records)) else {}),
                }
            )
            log.info(
                "passkey length=%d depth=%.2f: accuracy %.3f, exact %.3f",
                length,
                depth,
                hits / samples,
                exact / samples,
            )
    return rows


def _mean_speeds(records: list[dict]) -> dict[str, float]:
    """Per position, the mean of the samples' ``tokens_per_s_at`` (positions every sample reached)."""
    speeds = [r.get("tokens_per_s_at", {}) for r in records]
    common = set.intersection(*(set(x) for x in speeds)) if speeds else set()
    return {k: round(sum(x[k] for x in speeds) / len(speeds), 1) for k in sorted(common, key=int)}


def count_retrievals(records: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """Per group and check of ``retrieval_checks``: ``{"hits", "n"}`` over the samples that recorded it."""
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for record in records:
        for group, checks in record.get("retrieval", {}).items():
            for check, hit in checks.items():
                count = counts.setdefault(group, {}).setdefault(check, {"hits": 0, "n": 0})
                count["hits"] += int(hit)
                count["n"] += 1
    return counts


@dataclass(frozen=True)
class _SampleAt:
    """Which sample of a ``PasskeyGrid``: its length, depth (and the depth's index) and number."""

    length: int
    depth_index: int
    depth: float
    sample: int


def _run_sample(
    model: CausalLM,
    tokenizer: ModelTokenizer | ByteTokenizer,
    source: TokenSource,
    grid: PasskeyGrid,
    at: _SampleAt,
    *,
    budget: StreamBudget,
    on_tokens: Callable[[int], None] | None,
) -> dict:
    """Build sample ``at`` of ``grid`` on ``model``'s chunks and predict its answer; the record ``SampleLog`` keeps
    (``seconds``: building, streaming and decoding)."""
    t0 = time.perf_counter()
    streamed = 0
    rng = np.random.default_rng([grid.seed, at.length, at.depth_index, at.sample])
    sample = build_sample(
        source, tokenizer, grid.spec, length=at.length, depth=at.depth, rng=rng, chunk_size=model.cfg.chunk_size
    )
    speed = SpeedByPosition()

    def count(tokens: int) -> None:
        nonlocal streamed
        streamed += tokens
        if streamed <= sample.answer_start:  # the prefix; decoding the answer is timed by "seconds" only
            speed.add(streamed)
        if on_tokens is not None:
            on_tokens(tokens)

    picks: dict[tuple[int, int], list[list[int]]] = {}
    predicted = predict_answer(model, sample, budget=budget, on_tokens=count, picks=picks)
    if on_tokens is not None:  # the haystack after the answer is never streamed: the progress counts length
        on_tokens(at.length - streamed)
    answer = sample.ids[sample.answer_start : sample.answer_start + sample.answer_len].tolist()
    predicted_text = tokenizer.decode(predicted)
    seconds = time.perf_counter() - t0
    log.info(
        "passkey length=%d depth=%.2f sample %d: %s (key %s, predicted %r) in %.1f s, %.0f tokens/s",
        at.length,
        at.depth,
        at.sample,
        "right" if predicted == answer else "wrong",
        sample.key,
        predicted_text,
        seconds,
        at.length / seconds,
    )
    return {
        "length": at.length,
        "depth_index": at.depth_index,
        "depth": at.depth,
        "sample": at.sample,
        "key": sample.key,
        "answer": answer,
        "predicted": predicted,
        # The ids decoded by the export's tokenizer, so the file says what the model wrote without a tokenizer.
        "answer_text": tokenizer.decode(answer),
        "predicted_text": predicted_text,
        "seconds": round(seconds, 3),
        "tokens_per_s_at": speed.rows(),
        **({"retrieval": retrieval} if (retrieval := retrieval_checks(sample, picks, model.cfg.chunk_size)) else {}),
    }


def retrieval_checks(
    sample: TaskSample, picks: dict[tuple[int, int], list[list[int]]], chunk_size: int
) -> dict[str, dict[str, bool]]:
    """Per retrieval group ``g<i>``, what the answer's retrievals fetched: the two-hop checks
    (``HopChunks.followed``), else ``asked_needle`` -- the row of landmark ``c - 1``, which the chunk ``c``
    predicting the first answer token reads, holds a chunk of an asked needle -- and, for a sample that asks for
    several values (multivalue, multiquery), ``every_asked_needle``: that row holds every asked needle's chunks. An
    answer longer than a chunk is read through later rows too (``TaskSample.answer_rows``); where the prediction
    reached them, ``every_asked_needle_later``: each of them holds every asked needle's chunks as well. A wrong
    answer with the needles fetched is a copy error; without them, a retrieval error. Empty for a model without
    retrieval and for a sample without needles (RULER's word lists and QA)."""
    if sample.hop is not None:
        return sample.hop.followed(picks)
    if not sample.asked_chunks or sample.family in AGGREGATION_FAMILIES:  # a word list's words are no needles
        return {}
    first, *later = sample.answer_rows(chunk_size)
    checks = {}
    for group, query in sorted(picks):
        if query == first:
            fetched = set(picks[(group, query)][0])
            checks[f"g{group}"] = {"asked_needle": bool(sample.asked_chunks & fetched)}
            if len(sample.answers) > 1:
                checks[f"g{group}"]["every_asked_needle"] = sample.asked_chunks <= fetched
            reached = [picks[(group, row)][0] for row in later if (group, row) in picks]
            if reached:
                checks[f"g{group}"]["every_asked_needle_later"] = all(sample.asked_chunks <= set(r) for r in reached)
    return checks


SPEED_WINDOW = 65536
"""Tokens over which ``SpeedByPosition`` measures the speed before a position."""


class SpeedByPosition:
    """Streaming speed of one sample's prefix at positions ``4^k * 1024`` (from ``SPEED_WINDOW`` on) and at its end:
    the tokens/s over the ``SPEED_WINDOW`` tokens before each, so a long run shows whether its cost per token stays
    flat (``make demo-16m``: 1M, 4M and the end of a 16M prefix in one run). The end's window includes the last
    segment, streamed with every layer (``prefill``)."""

    def __init__(self) -> None:
        self._marks: collections.deque[tuple[int, float]] = collections.deque([(0, time.perf_counter())])
        self._next = 1024
        while self._next < SPEED_WINDOW:
            self._next *= 4
        self._rows: dict[str, float] = {}

    def add(self, position: int) -> None:
        """Record that the stream has reached ``position`` tokens now."""
        now = time.perf_counter()
        self._marks.append((position, now))
        while len(self._marks) > 2 and self._marks[1][0] <= position - SPEED_WINDOW:
            self._marks.popleft()
        while position >= self._next:
            self._rows[str(self._next)] = self._speed()
            self._next *= 4

    def rows(self) -> dict[str, float]:
        """``{position: tokens/s}`` at the marks passed, and at the last position recorded."""
        last = self._marks[-1][0]
        return {**self._rows, str(last): self._speed()} if last >= SPEED_WINDOW else dict(self._rows)

    def _speed(self) -> float:
        (first, start), (last, end) = self._marks[0], self._marks[-1]
        return round((last - first) / max(end - start, 1e-9), 1)

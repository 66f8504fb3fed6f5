"""Passkey / needle-in-a-haystack retrieval, laid out on the model's chunks (docs/evaluation.md).

A sample of ``length`` tokens is a haystack window with the needle(s), the question and the answer written over
it, laid out on the model's chunks exactly like the trainer's needle mix (``pipeline.data.needle.place_needle``): the
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

Variants (templates overridable with ``needle``, ``question``, ``answer``, ``link``):
- ``single``: one pass-key needle (the trainer's needle-mix texts, ``pipeline/data/needle.py``);
- ``multi``: ``needles`` key/value needles with distinct names; the question asks for one of them;
- ``multihop``: chains ``name -> next name -> key`` (a link needle plus a key needle); the question names the
  chain's start, so the key needle is found only by following the link (needs >= 2 retrieval groups in GCA).
"""

from __future__ import annotations

import collections
import logging
import re
import string
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model import CausalLM
from pipeline.data.needle import (
    ANSWER,
    HOP_TEMPLATES,
    NEEDLE,
    QUESTION,
    HopChunks,
    hop_texts,
    lay_out_multihop,
    move_answer_whitespace,
    new_name,
    place_needle,
    split_question,
)
from pipeline.evaluation.generate import decode, prefill
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.resume import SampleLog
from pipeline.evaluation.runtime import stream_state
from pipeline.evaluation.tokenizer import ByteTokenizer, SentencePieceTokenizer

log = logging.getLogger(__name__)

VARIANTS = ("single", "multi", "multihop")
TEMPLATES = {
    "single": {"needle": NEEDLE, "question": QUESTION, "answer": ANSWER, "link": ""},
    "multi": {
        "needle": " One of the special magic numbers for {name} is {key}. ",
        "question": " What is the special magic number for {name}? The special magic number for {name} is",
        "answer": " {key}",
        "link": "",
    },
    "multihop": HOP_TEMPLATES,  # the trainer's two-hop needle mix uses the same texts
}
PLACEHOLDERS = {
    "single": {"needle": {"key"}, "question": set(), "answer": {"key"}},
    "multi": {"needle": {"name", "key"}, "question": {"name"}, "answer": {"key"}},
    "multihop": {"needle": {"name", "key"}, "question": {"name"}, "answer": {"key"}, "link": {"name", "next"}},
}
"""Per variant, the templates it uses and the placeholders each must hold (exactly these): a needle without
``{key}`` hides nothing, an answer without it scores a constant, a question or link without ``{name}`` points
nowhere -- each would give a meaningless score, so they are refused before any work."""


@dataclass
class PasskeySample:
    ids: np.ndarray
    """``[length]`` token ids: haystack with needles, question and answer written over it (haystack after)."""
    answer_start: int
    """Index of the first answer token; the model's input is ``ids[:answer_start]``."""
    answer_len: int
    needle_start: int
    """Index of the key-bearing needle's first token."""
    needle_len: int
    room: int
    """Latest possible start of the key-bearing needle; depth d puts it at ``round(d * room)``."""
    key: str
    hop: HopChunks | None = None
    """multihop: the chunks of its parts, to check which ones each retrieval group fetched."""


@dataclass
class NeedleSpec:
    """What to hide and ask; ``None`` templates take the variant's default."""

    variant: str = "single"
    needle: str | None = None
    question: str | None = None
    answer: str | None = None
    link: str | None = None
    needles: int = 4
    """multi: needles in the haystack (one asked for); multihop: 2 x (needles // 2) needles in chains."""
    key_digits: int = 5

    def template(self, part: str) -> str:
        value = getattr(self, part)
        return TEMPLATES[self.variant][part] if value is None else value


def _fields(part: str, text: str) -> set[str]:
    """The placeholder names of a ``str.format`` template (``{key}``, ``{key:>6}`` -> ``key``)."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as err:  # unbalanced braces
        raise ValueError(f"{part}={text!r}: {err} (write a literal brace as {{{{ or }}}})") from None
    names = set()
    for _, name, _, _ in parsed:
        if name is not None:
            names.add(re.split(r"[.\[]", name, maxsplit=1)[0])
    return names


def check_templates(spec: NeedleSpec) -> None:
    """Refuse templates that would score nothing: a missing or unknown placeholder, an empty text, or a template
    the variant does not use.

    Raises:
        ValueError: naming the key, its text and the placeholders it needs.
    """
    if spec.variant not in PLACEHOLDERS:
        raise ValueError(f"variant={spec.variant!r} is not one of {VARIANTS}")
    used = PLACEHOLDERS[spec.variant]
    if spec.link is not None and "link" not in used:
        raise ValueError(f"link={spec.link!r}: only variant=multihop uses a link template (variant={spec.variant})")
    for part, needed in used.items():
        text = spec.template(part)
        if not text.strip():
            raise ValueError(
                f"{part}={text!r} is empty; give it some text" + (f" with {_braced(needed)}" if needed else "")
            )
        found = _fields(part, text)
        if found - needed:
            raise ValueError(
                f"{part}={text!r}: unknown placeholder(s) {_braced(found - needed)} for "
                f"variant={spec.variant} (available: {_braced(needed) or 'none'})"
            )
        if needed - found:
            raise ValueError(
                f"{part}={text!r} lacks the placeholder(s) {_braced(needed - found)} that "
                f"variant={spec.variant} needs: without it the passkey cannot be hidden, asked for or "
                "checked, so the score would mean nothing; add it"
            )
    if spec.variant == "multihop":
        split_question(spec.template("question"))  # the name must come before the words leading to the answer


def _braced(names: set[str]) -> str:
    return ", ".join("{" + n + "}" for n in sorted(names))


def _render(spec: NeedleSpec, part: str, **values: str) -> str:
    text = spec.template(part)
    try:
        return text.format(**values)
    except (KeyError, IndexError) as err:
        raise ValueError(
            f"{part}={text!r}: unknown placeholder {err} for variant={spec.variant} "
            f"(available: {', '.join('{' + k + '}' for k in values)})"
        ) from None


def build_sample(
    source: TokenSource,
    tokenizer: SentencePieceTokenizer | ByteTokenizer,
    spec: NeedleSpec,
    length: int,
    depth: float,
    rng: np.random.Generator,
    chunk_size: int,
) -> PasskeySample:
    """One passkey sequence of ``length`` tokens, laid out on the model's chunks
    (``pipeline.data.needle.place_needle``).

    Raises:
        ValueError: ``length`` cannot hold the needles, question and answer; a template is malformed.
    """
    enc = tokenizer.encode

    def new_key() -> str:
        return str(int(rng.integers(10 ** (spec.key_digits - 1), 10**spec.key_digits)))

    key = new_key()
    if spec.variant == "multihop":
        return _build_multihop(source, tokenizer, spec, length, depth, rng, chunk_size, key, new_key)
    names: set[str] = set()
    target_name = new_name(rng, names)
    if spec.variant == "single":
        target = enc(_render(spec, "needle", key=key))
        others: list[list[int]] = []
        question = enc(_render(spec, "question"))
    else:
        target = enc(_render(spec, "needle", name=target_name, key=key))
        others = [
            enc(_render(spec, "needle", name=new_name(rng, names), key=new_key())) for _ in range(spec.needles - 1)
        ]
        question = enc(_render(spec, "question", name=target_name))
    question, answer = move_answer_whitespace(question, enc(_render(spec, "answer", key=key)), tokenizer.decode)

    where = place_needle(length, chunk_size, len(target), len(question), len(answer), depth)
    ids = source.window(length, rng).astype(np.int64)  # overwritten by needles, question and answer
    taken = [(where.needle_start, where.needle_start + len(target)), (where.question_start, length)]
    for needle in others:  # distractors and links: random free spots before the question
        for _ in range(1000):
            at = int(rng.integers(0, max(where.question_start - len(needle), 0) + 1))
            if at + len(needle) <= where.question_start and all(at + len(needle) <= lo or at >= hi for lo, hi in taken):
                break
        else:
            raise ValueError(
                f"length={length} is too short to place {len(others) + 1} {spec.variant} needles "
                "without overlap; use longer lengths or fewer needles"
            )
        ids[at : at + len(needle)] = needle
        taken.append((at, at + len(needle)))
    ids[where.needle_start : where.needle_start + len(target)] = target
    ids[where.question_start : where.answer_start] = question
    ids[where.answer_start : where.answer_start + len(answer)] = answer
    return PasskeySample(
        ids, where.answer_start, len(answer), where.needle_start, len(target), where.question_start - len(target), key
    )


def _build_multihop(
    source: TokenSource,
    tokenizer: SentencePieceTokenizer | ByteTokenizer,
    spec: NeedleSpec,
    length: int,
    depth: float,
    rng: np.random.Generator,
    chunk_size: int,
    key: str,
    new_key: Callable[[], str],
) -> PasskeySample:
    """A two-hop sample, laid out by the trainer's ``pipeline.data.needle.lay_out_multihop``: the key needle at
    ``depth``, the link and ``needles // 2 - 1`` distractor chains in chunks of their own."""
    templates = {part: spec.template(part) for part in ("needle", "link", "question", "answer")}
    texts = hop_texts(tokenizer.encode, tokenizer.decode, templates, key, new_key, rng, spec.needles // 2)
    window = source.window(length, rng).astype(np.int64)
    ids, where = lay_out_multihop(window, texts, chunk_size, depth, rng)
    return PasskeySample(
        ids,
        where.answer_start,
        len(texts.answer),
        where.needle_start,
        len(texts.needle),
        where.room,
        key,
        HopChunks.of(where, texts, chunk_size),
    )


def predict_answer(
    model: CausalLM,
    sample: PasskeySample,
    segment: int,
    offload_mb: int = -1,
    offload_dir: str | None = None,
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
    with stream_state(model, offload_mb, offload_dir) as state:
        state.picks = picks
        last = prefill(model, state, prefix, segment, on_tokens, skip_far_layers=True)
        return list(decode(model, state, last, sample.answer_len, on_tokens=on_tokens))


def evaluate_passkey(
    model: CausalLM,
    tokenizer: SentencePieceTokenizer | ByteTokenizer,
    source: TokenSource,
    spec: NeedleSpec,
    lengths: list[int],
    depths: list[float],
    samples: int,
    seed: int,
    segment: int,
    chunk_size: int,
    offload_mb: int = -1,
    offload_dir: str | None = None,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
    finished: SampleLog | None = None,
) -> list[dict]:
    """Rows ``{"length", "depth", "accuracy", "exact_match", "n", "seconds", "seconds_per_sample",
    "tokens_per_s", "tokens_per_s_at"}`` per (length, depth) (``tokens_per_s_at``: ``SpeedByPosition``).

    ``finished``: samples it holds are taken from it instead of being run, and every sample run is added to it as
    it finishes (a killed run continues from there). ``progress(length, tokens)`` gets the tokens still to stream
    at that length (its samples' ``length`` tokens each, the finished ones left out).
    """
    rows = []
    for length in lengths:
        keys = [(length, d, depth, s) for d, depth in enumerate(depths) for s in range(samples)]
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
        for d, depth in enumerate(depths):
            records = []
            for s in range(samples):
                record = finished.get((length, d, depth, s)) if finished else None
                if record is None:
                    record = _run_sample(
                        model,
                        tokenizer,
                        source,
                        spec,
                        length,
                        d,
                        depth,
                        s,
                        seed,
                        segment,
                        chunk_size,
                        offload_mb,
                        offload_dir,
                        on_tokens,
                    )
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
                    **({"retrieval": retrieval} if (retrieval := _count_retrievals(records)) else {}),
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


def _count_retrievals(records: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """Per group and check of ``HopChunks.followed``: ``{"hits", "n"}`` over the samples that recorded it."""
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for record in records:
        for group, checks in record.get("retrieval", {}).items():
            for check, hit in checks.items():
                count = counts.setdefault(group, {}).setdefault(check, {"hits": 0, "n": 0})
                count["hits"] += int(hit)
                count["n"] += 1
    return counts


def _run_sample(
    model: CausalLM,
    tokenizer: SentencePieceTokenizer | ByteTokenizer,
    source: TokenSource,
    spec: NeedleSpec,
    length: int,
    d: int,
    depth: float,
    s: int,
    seed: int,
    segment: int,
    chunk_size: int,
    offload_mb: int,
    offload_dir: str | None,
    on_tokens: Callable[[int], None] | None,
) -> dict:
    """Build sample ``s`` of (``length``, depth number ``d``) and predict its answer; the record ``SampleLog`` keeps
    (``seconds``: building, streaming and decoding)."""
    t0 = time.perf_counter()
    streamed = 0
    sample = build_sample(
        source, tokenizer, spec, length, depth, np.random.default_rng([seed, length, d, s]), chunk_size
    )
    speed = SpeedByPosition()

    def count(tokens: int) -> None:
        nonlocal streamed
        streamed += tokens
        if streamed <= sample.answer_start:  # the prefix; decoding the answer is timed by "seconds" only
            speed.add(streamed)
        if on_tokens is not None:
            on_tokens(tokens)

    picks: dict[tuple[int, int], list[list[int]]] | None = {} if sample.hop is not None else None
    predicted = predict_answer(model, sample, segment, offload_mb, offload_dir, count, picks)
    if on_tokens is not None:  # the haystack after the answer is never streamed: the progress counts length
        on_tokens(length - streamed)
    answer = sample.ids[sample.answer_start : sample.answer_start + sample.answer_len].tolist()
    seconds = time.perf_counter() - t0
    log.info(
        "passkey length=%d depth=%.2f sample %d: %s (key %s, predicted %r) in %.1f s, %.0f tokens/s",
        length,
        depth,
        s,
        "right" if predicted == answer else "wrong",
        sample.key,
        tokenizer.decode(predicted),
        seconds,
        length / seconds,
    )
    return {
        "length": length,
        "depth_index": d,
        "depth": depth,
        "sample": s,
        "key": sample.key,
        "answer": answer,
        "predicted": predicted,
        "seconds": round(seconds, 3),
        "tokens_per_s_at": speed.rows(),
        **({"retrieval": sample.hop.followed(picks)} if sample.hop is not None and picks is not None else {}),
    }


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

"""The retrieval task families, each built by one function that the trainer's mix and the eval share.

A sample is a haystack (real text of the training split, or the eval's haystack) with needles, a question and
its answer written over it, laid out on the model's chunk grid: the question's last token is the first token of
a chunk, so the answer is predicted by a chunk whose retrieval the question's landmark triggered, and a needle
that fits in a chunk never straddles two. ``build_task`` is the only entry point: ``pipeline.data.mix`` calls it
for training sequences and ``pipeline.evaluation.passkey`` for evaluation samples, so what is trained and what
is evaluated cannot drift.

Families (RULER's names where it has the task):

- ``single``: one pass-key needle, asked for (``pipeline.data.needle``'s texts and layout).
- ``multikey``: ``needles`` key/value needles with distinct names, one asked for. Other shapes (RULER's
  ``niah_single_3`` and ``niah_multikey_2/3``): ``value_kind="uuid"`` makes every value a random UUID
  (``8-4-4-4-12`` hex digits; the trainer's mix too, with ``data.retrieval_mix.value_kind=uuid``, for every family),
  and, for the eval only, ``name_kind="uuid"`` makes every name one, and ``needle_haystack=True`` fills the whole
  context before the question with needles of that form (``needles`` is then unused: as many as fit, each with its
  own name and value), laid back to back, with the haystack's text only padding the few tokens left free at the
  start; the asked one is the needle at the drawn depth among them.
- ``multivalue``: ``values`` needles of one name with distinct values, all asked for, in the order they appear.
- ``multiquery``: ``needles`` needles with distinct names, ``queries`` of them asked for, in the question's order.
- ``vt`` (variable tracking): ``chains`` chains ``A = 48213``, ``B = A``, ``C = B`` (``hops`` copies after the
  value), each statement in a chunk of its own and every chain in order; the question gives the asked chain's
  value and the answer lists its names in chain order. Following a copy takes another retrieval, so the later
  names need several hops.
- ``multihop``: two-hop chains ``name -> next name -> key`` (``pipeline.data.needle``'s two-hop layout).

Aggregation families (``AGGREGATION_FAMILIES``, RULER's; the trainer's mix never draws them, so they stay held out
of training): the context before the question is a word list that fills the sequence, built over the haystack's
length (the haystack's text only pads the few tokens the list leaves free, at the start), and ``depth`` is unused.

- ``cwe`` (common words extraction): a numbered list ``1. kalomi 2. terufa ...`` in which ``common_words`` words
  appear ``common_repeats`` times each and every other word ``uncommon_repeats`` times; the answer lists the
  common words in order of first appearance. When ``common_repeats`` rounds of the common words would take more
  than half the context (short sequences), the common words repeat as often as fits in that half and the others
  ``min(uncommon_repeats, repeats - 1)`` times (RULER shortens its short-context lists the same way).
- ``fwe`` (frequent words extraction): made-up words whose counts follow Zipf's law, the ``k``-th most frequent
  word ``floor(n * k**-zipf_alpha / zeta(zipf_alpha))`` times, shuffled, the most frequent of all being the noise
  word ``...``; the answer lists the ``frequent_words`` next most frequent words, most frequent first. Its
  vocabulary grows with the sequence (one word per 50 tokens, at least ``frequent_words + 2``), as RULER's does.

Every family but ``single`` (and ``multikey``'s ``needle_haystack``, whose context is all needles) puts each
needle in chunks that no other needle or the question touches, so one retrieved chunk never brings two needles.
``depth`` (0: the start, 1: right before the question) places the first asked needle; ``vt`` places its statements
at random chunks (its chains must keep their order, so no single statement can be put at a given depth). A needle
longer than a chunk ends with a chunk, so the key shares its chunk with the words before it (its name).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.data.needle import (
    SYLLABLES,
    VALUE_KINDS,
    HopChunks,
    NeedleSpec,
    chunks_of,
    free_spot,
    hop_texts,
    in_chunk_at,
    lay_out_multihop,
    lay_out_needle,
    move_answer_whitespace,
    needle_parts,
    new_name,
    render,
)

FAMILIES = ("single", "multikey", "multivalue", "multiquery", "vt", "multihop")
"""Every retrieval task family, in the order reports list them; the trainer's mix draws from these."""
AGGREGATION_FAMILIES = ("cwe", "fwe")
"""RULER's aggregation families: ``build_task`` builds them, the trainer's mix refuses them (held out)."""
ALL_FAMILIES = FAMILIES + AGGREGATION_FAMILIES

FIXED_TEMPLATES = {
    "multivalue": {
        "needle": " {name} has number {key}. ",
        "question": " What numbers does {name} have? They are",
    },
    "multiquery": {
        "needle": " {name} has number {key}. ",
        "question": " What numbers do {names} have? They are",
    },
    "vt": {
        "value": " {name} = {key}. ",
        "copy": " {name} = {previous}. ",
        "question": " Which names equal {key}? They are",
    },
}
"""The texts of the families whose templates are not configurable. Short on purpose: with the two-syllable names
these families use, a needle fits in one 16-token chunk of the demo's tokenizer. Answers list the asked values
(or names) joined by ``ANSWER_SEPARATOR``, after one space."""
AGGREGATION_TEMPLATES = {
    "cwe": {
        "number": " {number}.",
        "word": " {word}",
        "question": " What are the {count} most common words in the list above? They are",
    },
    "fwe": {
        "word": " {word}",
        "question": " Leaving out the dots, what are the {count} most frequent words above? They are",
    },
}
"""The texts of ``AGGREGATION_FAMILIES``; answers as ``FIXED_TEMPLATES``' (the words joined). A ``cwe`` item is its
number's text, then its word's (`` 1. kalomi``)."""
NOISE_WORD = "..."
"""fwe: the most frequent word of all, which the question leaves out (RULER's)."""
ANSWER_SEPARATOR = ", "
NAME_KINDS = ("word", "uuid")


@dataclass(frozen=True)
class TaskShape:
    """How many needles, values, queries, hops and chains a sample of each family holds."""

    needles: int = 4
    """multikey, multiquery: needles in the haystack (distinct names)."""
    values: int = 3
    """multivalue: needles of the asked name, all asked for."""
    queries: int = 2
    """multiquery: needles asked for (at most ``needles``)."""
    hops: int = 2
    """vt: copies after the value in each chain (``A = 48213``, then ``hops`` statements ``B = A`` ...)."""
    chains: int = 2
    """vt, multihop: chains in a sample, the asked one included."""
    key_digits: int = 5
    """Digits of every key."""
    common_words: int = 10
    """cwe: words that appear ``common_repeats`` times, all asked for."""
    common_repeats: int = 30
    """cwe: how often each common word appears (fewer in short sequences, see the module docstring)."""
    uncommon_repeats: int = 3
    """cwe: how often each other word appears."""
    frequent_words: int = 3
    """fwe: the most frequent words asked for (the noise word ``...`` not counted)."""
    zipf_alpha: float = 2.0
    """fwe: the exponent of the words' Zipf counts (above 1)."""
    value_kind: str = "number"
    """multikey: ``number`` (``key_digits`` digits) or ``uuid`` values."""
    name_kind: str = "word"
    """multikey: ``word`` (made-up names) or ``uuid`` names."""
    needle_haystack: bool = False
    """multikey: the context is needles only, as many as fit (``needles`` unused)."""

    def check(self) -> None:
        """Raises ValueError naming the field when a count cannot make a sample."""
        counts = ("needles", "values", "queries", "hops", "chains", "key_digits", "common_words", "uncommon_repeats")
        for name in (*counts, "frequent_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.queries > self.needles:
            raise ValueError(f"queries={self.queries} cannot exceed needles={self.needles}")
        if self.common_repeats <= self.uncommon_repeats:
            raise ValueError(
                f"common_repeats={self.common_repeats} must exceed uncommon_repeats={self.uncommon_repeats}"
            )
        if self.value_kind not in VALUE_KINDS:
            raise ValueError(f"value_kind={self.value_kind!r} is not one of {VALUE_KINDS}")
        if self.name_kind not in NAME_KINDS:
            raise ValueError(f"name_kind={self.name_kind!r} is not one of {NAME_KINDS}")
        if not self.zipf_alpha > 1.0:
            raise ValueError(f"zipf_alpha={self.zipf_alpha} must be > 1 (the Zipf sum diverges otherwise)")


DEFAULT_SHAPE = TaskShape()


@dataclass(frozen=True)
class Codec:
    """The tokenizer, as the two functions a sample needs."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


@dataclass
class TaskSample:
    """One sample: token ids with everything written over the haystack, and where its parts are."""

    ids: np.ndarray
    """``[length]`` token ids (haystack after the answer)."""
    family: str
    answer_start: int
    """Index of the first answer token; an eval's input is ``ids[:answer_start]``."""
    answer_len: int
    needle_start: int
    """Index of the first asked needle's first token."""
    needle_len: int
    room: int
    """Latest possible start of the first asked needle; depth d puts it at ``round(d * room)``."""
    key: str
    """The answer's text without its leading space (the key, or the asked values/names joined)."""
    answers: tuple[str, ...]
    """The asked values (or ``vt`` names), in answer order."""
    distractors: tuple[str, ...] = ()
    """The values of needles that are not asked for (``vt``: the other chains' names)."""
    asked_chunks: frozenset[int] = frozenset()
    """Chunks holding the needles the answer needs."""
    hop: HopChunks | None = None
    """multihop: the chunks of its parts, to check which ones each retrieval group fetched."""

    @property
    def answer(self) -> slice:
        return slice(self.answer_start, self.answer_start + self.answer_len)

    def question_row(self, chunk_size: int) -> int:
        """The landmark whose retrieval serves the answer: the first answer token is predicted at the question's
        last token, which opens a chunk ``c`` (the layout's rule), and chunk ``c`` reads the row of landmark
        ``c - 1``."""
        return (self.answer_start - 1) // chunk_size - 1

    def answer_rows(self, chunk_size: int) -> range:
        """Every landmark whose retrieval serves the answer, the question's first: answer token ``i`` is predicted
        at position ``answer_start + i - 1``, whose chunk reads the row of the landmark before it, so an answer
        longer than a chunk is read through several rows."""
        last_chunk = (self.answer_start + self.answer_len - 2) // chunk_size
        return range(self.question_row(chunk_size), last_chunk)


def default_spec(family: str, shape: TaskShape) -> NeedleSpec:
    """The texts of a ``family`` sample of ``shape``: the family's own (``NeedleSpec.template``; multikey's say
    "uuid" for UUID values)."""
    return NeedleSpec(variant=family, key_digits=shape.key_digits, value_kind=shape.value_kind)


def build_task(
    family: str,
    haystack: np.ndarray,
    codec: Codec,
    rng: np.random.Generator,
    *,
    chunk_size: int,
    shape: TaskShape = DEFAULT_SHAPE,
    spec: NeedleSpec | None = None,
    depth: float | None = None,
) -> TaskSample:
    """A ``family`` sample written over a copy of ``haystack`` (int64 token ids, its length the sample's).

    Args:
        rng: every random choice (keys, names, spots) in a fixed order, so one seed gives one sample.
        spec: the texts of ``single``, ``multikey`` and ``multihop`` (``NeedleSpec``; default: ``default_spec``).
        depth: where the first asked needle goes; ``None`` draws it from ``rng`` when the layout needs it (the
            trainer's mix), after the keys and names.

    Raises:
        ValueError: ``haystack`` cannot hold the sample, or an unknown family.
    """
    if family not in ALL_FAMILIES:
        raise ValueError(f"retrieval task family {family!r} is not one of {ALL_FAMILIES}")
    spec = spec or default_spec(family, shape)
    builder = _BUILDERS[family]
    return builder(_Context(haystack, codec, rng, chunk_size, shape, spec, depth))


@dataclass
class _Context:
    haystack: np.ndarray
    codec: Codec
    rng: np.random.Generator
    chunk_size: int
    shape: TaskShape
    spec: NeedleSpec
    depth: float | None
    keys: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)

    def new_key(self) -> str:
        """A key of ``key_digits`` digits (a UUID for ``value_kind="uuid"``) not used in this sample yet (a
        distractor never equals an answer)."""
        if self.shape.value_kind == "uuid":
            return _new_uuid(self.rng, self.keys)
        digits = self.shape.key_digits
        if len(self.keys) >= 9 * 10 ** (digits - 1):  # the loop below would never end
            raise ValueError(f"a sample needs more than the {len(self.keys)} distinct keys of {digits} digits")
        while True:
            key = str(int(self.rng.integers(10 ** (digits - 1), 10**digits)))
            if key not in self.keys:
                self.keys.add(key)
                return key

    def draw_depth(self) -> float:
        return float(self.rng.random()) if self.depth is None else self.depth

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)


def _single(c: _Context) -> TaskSample:
    key = c.new_key()
    needle, question, answer = needle_parts(c.spec, c.encode, c.codec.decode, key)
    out, where = lay_out_needle(c.haystack, needle, question, answer, depth=c.draw_depth(), chunk_size=c.chunk_size)
    return TaskSample(
        ids=out,
        family="single",
        answer_start=where.answer_start,
        answer_len=len(answer),
        needle_start=where.needle_start,
        needle_len=len(needle),
        room=where.question_start - len(needle),
        key=key,
        answers=(key,),
        asked_chunks=frozenset(chunks_of(where.needle_start, len(needle), c.chunk_size)),
    )


def _new_uuid(rng: np.random.Generator, taken: set[str]) -> str:
    """A random (version 4) UUID not in ``taken`` (added to it), drawn from ``rng``."""
    while True:
        text = str(uuid.UUID(bytes=rng.bytes(16), version=4))
        if text not in taken:
            taken.add(text)
            return text


def _multikey_name(c: _Context, syllables: int = 3) -> str:
    return _new_uuid(c.rng, c.names) if c.shape.name_kind == "uuid" else new_name(c.rng, c.names, syllables)


def _multikey(c: _Context) -> TaskSample:
    if c.shape.needle_haystack:
        return _needle_haystack(c)
    key = c.new_key()
    asked = _multikey_name(c)
    needle, question, answer = needle_parts(c.spec, c.encode, c.codec.decode, key, name=asked)
    distractors = [c.new_key() for _ in range(c.shape.needles - 1)]
    others = [c.encode(render(c.spec, "needle", name=_multikey_name(c), key=k)) for k in distractors]
    layout = _lay_out_apart(c, [needle, *others], question, len(answer))
    return _sample(c, "multikey", layout, answer, [key], tuple(distractors), [needle, *others], range(1))


def _needle_haystack(c: _Context) -> TaskSample:
    """``multikey`` with ``needle_haystack``: needles back to back up to the question, the asked one at the drawn
    depth among them (``room``: the latest start it could have)."""
    S, length = c.chunk_size, len(c.haystack)
    # Names of enough syllables that four times the needles that can fit have names to draw from (so drawing a new
    # one stays quick); the shortest needle text bounds how many fit.
    shortest = len(c.encode(render(c.spec, "needle", name="Ka", key="0")))
    syllables = 3
    while len(SYLLABLES) ** syllables < 4 * (length // max(shortest, 1) + 1):
        syllables += 1
    key = c.new_key()
    asked = _multikey_name(c, syllables)
    needle, question, answer = needle_parts(c.spec, c.encode, c.codec.decode, key, name=asked)
    answer_start, question_start = question_spot(length, S, len(question), len(answer))
    others: list[list[int]] = []
    distractors: list[str] = []
    total = len(needle)
    while True:
        value = c.new_key()
        ids = c.encode(render(c.spec, "needle", name=_multikey_name(c, syllables), key=value))
        if total + len(ids) > question_start:
            break
        others.append(ids)
        distractors.append(value)
        total += len(ids)
    if not others:
        raise ValueError(
            f"a sequence of {length} tokens has no room for two needles before a question of {len(question)} tokens"
        )
    at = round(c.draw_depth() * len(others))
    needles = [*others[:at], needle, *others[at:]]
    start = question_start - total
    out = c.haystack.copy()
    out[start:question_start] = [t for ids in needles for t in ids]
    out[question_start:answer_start] = question
    out[answer_start : answer_start + len(answer)] = answer
    needle_start = start + sum(len(ids) for ids in others[:at])
    return TaskSample(
        ids=out,
        family="multikey",
        answer_start=answer_start,
        answer_len=len(answer),
        needle_start=needle_start,
        needle_len=len(needle),
        room=question_start - len(needle),
        key=key,
        answers=(key,),
        distractors=tuple(distractors),
        asked_chunks=frozenset(chunks_of(needle_start, len(needle), S)),
    )


def _multihop(c: _Context) -> TaskSample:
    key = c.new_key()
    templates = {part: c.spec.template(part) for part in ("needle", "link", "question", "answer")}
    texts = hop_texts(c.encode, c.codec.decode, templates, key, c.new_key, c.rng, c.shape.chains)
    out, hop = lay_out_multihop(c.haystack, texts, c.chunk_size, c.draw_depth(), c.rng)
    chunks = HopChunks.of(hop, texts, c.chunk_size)
    return TaskSample(
        ids=out,
        family="multihop",
        answer_start=hop.answer_start,
        answer_len=len(texts.answer),
        needle_start=hop.needle_start,
        needle_len=len(texts.needle),
        room=hop.room,
        key=key,
        answers=(key,),
        distractors=tuple(sorted(c.keys - {key})),
        asked_chunks=chunks.link | chunks.key,
        hop=chunks,
    )


def _multivalue(c: _Context) -> TaskSample:
    texts = FIXED_TEMPLATES["multivalue"]
    name = new_name(c.rng, c.names, 2)
    keys = [c.new_key() for _ in range(c.shape.values)]
    needles = [c.encode(texts["needle"].format(name=name, key=k)) for k in keys]
    question, answer = _answer_ids(c, c.encode(texts["question"].format(name=name)), keys)
    layout = _lay_out_apart(c, needles, question, len(answer))
    # The answer lists the values in the order they appear, which is known only now.
    order = sorted(range(len(keys)), key=lambda i: layout.starts[i])
    in_order = [keys[i] for i in order]
    final_question, answer = _answer_ids(c, c.encode(texts["question"].format(name=name)), in_order)
    if final_question != question:
        raise ValueError("the question's tokens changed with the answer's order")  # the mix draws again
    return _sample(c, "multivalue", layout, answer, in_order, (), needles, asked=range(len(keys)))


def _multiquery(c: _Context) -> TaskSample:
    texts = FIXED_TEMPLATES["multiquery"]
    names = [new_name(c.rng, c.names, 2) for _ in range(c.shape.needles)]
    keys = [c.new_key() for _ in names]
    needles = [c.encode(texts["needle"].format(name=n, key=k)) for n, k in zip(names, keys)]
    asked = c.shape.queries  # the first ``queries`` needles, asked in their drawn order
    question = c.encode(texts["question"].format(names=_spoken_list(names[:asked])))
    question, answer = _answer_ids(c, question, keys[:asked])
    layout = _lay_out_apart(c, needles, question, len(answer))
    return _sample(c, "multiquery", layout, answer, keys[:asked], tuple(keys[asked:]), needles, range(asked))


def _vt(c: _Context) -> TaskSample:
    texts = FIXED_TEMPLATES["vt"]
    chains = []  # per chain: its names, value and statements in order
    for _ in range(c.shape.chains):
        names = [new_name(c.rng, c.names, 2) for _ in range(c.shape.hops + 1)]
        value = c.new_key()
        statements = [c.encode(texts["value"].format(name=names[0], key=value))]
        statements += [
            c.encode(texts["copy"].format(name=name, previous=previous)) for previous, name in zip(names, names[1:])
        ]
        chains.append((names, value, statements))
    names, value, _ = chains[0]
    question = c.encode(texts["question"].format(key=value))
    question, answer = _answer_ids(c, question, names)
    S = c.chunk_size
    longest = max(len(s) for _, _, statements in chains for s in statements)
    if longest > S:
        raise ValueError(
            f"a variable-tracking statement takes {longest} tokens, more than chunk_size={S}: each must fit in "
            "one chunk so that the chains keep their order"
        )
    answer_start, question_start = question_spot(len(c.haystack), S, len(question), len(answer))
    free = list(range(question_start // S))  # chunks that end before the question's first chunk
    count = sum(len(statements) for _, _, statements in chains)
    if len(free) < count:
        raise ValueError(
            f"a sequence of {len(c.haystack)} tokens with chunk_size={S} has {len(free)} chunks before the "
            f"question, fewer than the {count} variable-tracking statements (each in a chunk of its own); use longer "
            "sequences or fewer chains/hops"
        )
    picked = sorted(int(k) for k in c.rng.choice(free, size=count, replace=False))
    owners = c.rng.permutation([i for i, (_, _, statements) in enumerate(chains) for _ in statements])
    out = c.haystack.copy()
    next_statement = [0] * len(chains)
    asked_starts = []
    for chunk, owner in zip(picked, owners.tolist()):
        statement = chains[owner][2][next_statement[owner]]
        next_statement[owner] += 1
        at = chunk * S + int(c.rng.integers(0, S - len(statement) + 1))
        out[at : at + len(statement)] = statement
        if owner == 0:
            asked_starts.append(at)
    out[question_start:answer_start] = question
    out[answer_start : answer_start + len(answer)] = answer
    first = chains[0][2][0]
    return TaskSample(
        ids=out,
        family="vt",
        answer_start=answer_start,
        answer_len=len(answer),
        needle_start=asked_starts[0],
        needle_len=len(first),
        room=question_start // S * S - len(first),
        key=ANSWER_SEPARATOR.join(names),
        answers=tuple(names),
        distractors=tuple(n for chain_names, _, _ in chains[1:] for n in chain_names),
        asked_chunks=frozenset(at // S for at in asked_starts),
    )


@dataclass(frozen=True)
class _Apart:
    """Where ``_lay_out_apart`` put the needles and the question."""

    out: np.ndarray
    starts: list[int]
    question_start: int
    answer_start: int
    room: int


def question_spot(length: int, chunk_size: int, question_len: int, answer_len: int) -> tuple[int, int]:
    """(answer start, question start): the answer starts one token into the last chunk that leaves it room, so the
    question's last token is that chunk's first (as ``needle.place_needle``)."""
    S = chunk_size
    answer_start = (length - answer_len - 1) // S * S + 1
    question_start = answer_start - question_len
    if question_start < 0:
        raise ValueError(
            f"a sequence of {length} tokens cannot hold a question of {question_len} tokens and an answer of "
            f"{answer_len} with chunk_size={S}"
        )
    return answer_start, question_start


def _lay_out_apart(c: _Context, needles: list[list[int]], question: list[int], answer_len: int) -> _Apart:
    """Needles each in chunks no other needle or the question touches: ``needles[0]`` in the chunk at the drawn
    depth, the others at random free spots (``needle.free_spot``); then the question and room for the answer."""
    S, length = c.chunk_size, len(c.haystack)
    answer_start, question_start = question_spot(length, S, len(question), answer_len)
    limit = question_start // S * S  # needles end before the question's first chunk
    room = limit - len(needles[0])
    if room < 0:
        raise ValueError(
            f"a sequence of {length} tokens with chunk_size={S} has no room for a needle of {len(needles[0])} "
            f"tokens before a question of {len(question)}"
        )
    first = in_chunk_at(c.draw_depth(), room, S, len(needles[0]), c.rng)
    busy = chunks_of(first, len(needles[0]), S) | set(range(question_start // S, -(-length // S)))
    starts = [first]
    for needle in needles[1:]:
        at = free_spot(len(needle), limit, busy, S, c.rng)
        if at is None:
            raise ValueError(
                f"a sequence of {length} tokens with chunk_size={S} has too few free chunks before the question "
                f"for {len(needles)} needles, each in chunks of its own; use longer sequences or fewer needles"
            )
        busy |= chunks_of(at, len(needle), S)
        starts.append(at)
    out = c.haystack.copy()
    for at, needle in zip(starts, needles):
        out[at : at + len(needle)] = needle
    out[question_start:answer_start] = question
    return _Apart(out, starts, question_start, answer_start, room)


def _answer_ids(c: _Context, question: list[int], items: list[str]) -> tuple[list[int], list[int]]:
    """The question and the answer listing ``items``, the answer's leading whitespace moved into the question."""
    answer = c.encode(" " + ANSWER_SEPARATOR.join(items))
    return move_answer_whitespace(question, answer, c.codec.decode)


def _sample(
    c: _Context,
    family: str,
    layout: _Apart,
    answer: list[int],
    answers: list[str],
    distractors: tuple[str, ...],
    needles: list[list[int]],
    asked: range,
) -> TaskSample:
    """Write ``answer`` (listing ``answers``) after the question laid out in ``layout``.

    Raises:
        ValueError: it is longer than the room the layout made for it (its order changed its tokens); the mix
            draws again.
    """
    end = layout.answer_start
    if end + len(answer) > len(layout.out):
        raise ValueError(f"the answer ({len(answer)} tokens) does not fit after the question")
    layout.out[end : end + len(answer)] = answer
    S = c.chunk_size
    return TaskSample(
        ids=layout.out,
        family=family,
        answer_start=end,
        answer_len=len(answer),
        needle_start=layout.starts[0],
        needle_len=len(needles[0]),
        room=layout.room,
        key=ANSWER_SEPARATOR.join(answers),
        answers=tuple(answers),
        distractors=distractors,
        asked_chunks=frozenset(k for i in asked for k in chunks_of(layout.starts[i], len(needles[i]), S)),
    )


def _spoken_list(names: list[str]) -> str:
    """``A``, ``A and B``, ``A, B and C``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _new_word(c: _Context) -> str:
    """A made-up lower-case word of 3 to 5 syllables not used in this sample yet (``needle.SYLLABLES``)."""
    while True:
        word = "".join(c.rng.choice(SYLLABLES, size=int(c.rng.integers(3, 6))))
        if word not in c.names:
            c.names.add(word)
            return word


def _cwe(c: _Context) -> TaskSample:
    texts, shape, S, length = AGGREGATION_TEMPLATES["cwe"], c.shape, c.chunk_size, len(c.haystack)
    common = [_new_word(c) for _ in range(shape.common_words)]
    question = c.encode(texts["question"].format(count=shape.common_words))
    _, limit = question_spot(length, S, len(question), len(_answer_ids(c, question, common)[1]))
    word_ids = {w: c.encode(texts["word"].format(word=w)) for w in common}
    number_len = max(len(c.encode(texts["number"].format(number=n))) for n in (1, limit))
    round_len = sum(len(ids) + number_len for ids in word_ids.values())
    repeats = min(shape.common_repeats, limit // 2 // round_len)
    if repeats < 2:
        raise ValueError(
            f"a sequence of {length} tokens has no room for 2 rounds of {shape.common_words} common words "
            f"({round_len} tokens a round) in half of its context; use longer sequences or fewer common_words"
        )
    uncommon_repeats = min(shape.uncommon_repeats, repeats - 1)
    # Enough uncommon words to overfill the list; the items that do not fit are left out below.
    wanted = int(1.2 * limit * shape.common_words / round_len) - repeats * shape.common_words
    uncommon = [_new_word(c) for _ in range(max(wanted, 0) // uncommon_repeats + 1)]
    items = common * repeats + uncommon * uncommon_repeats
    items = [items[i] for i in c.rng.permutation(len(items)).tolist()]
    in_order = list(dict.fromkeys(w for w in items if w in word_ids))  # the common words by first appearance
    question, answer = _answer_ids(c, question, in_order)
    answer_start, question_start = question_spot(length, S, len(question), len(answer))
    # An item goes in if it fits; an uncommon one only while the common items still to come keep room enough.
    reserve = max(len(ids) for ids in word_ids.values()) + number_len + 2
    common_left = repeats * shape.common_words
    tokens: list[int] = []
    common_at: list[int] = []
    numbered = 0
    for word in items:
        is_common = word in word_ids
        ids = word_ids[word] if is_common else c.encode(texts["word"].format(word=word))
        item = c.encode(texts["number"].format(number=numbered + 1)) + ids
        room = question_start - len(tokens) - (common_left - is_common) * reserve
        if len(item) > room:
            if is_common:
                raise ValueError(f"the {shape.common_words} common words no longer fit in {length} tokens")
            continue
        if is_common:
            common_at.append(len(tokens))
            common_left -= 1
        tokens += item
        numbered += 1
    return _word_list_sample(c, "cwe", tokens, question, answer, (answer_start, question_start), in_order, common_at)


def _fwe(c: _Context) -> TaskSample:
    texts, shape, S, length = AGGREGATION_TEMPLATES["fwe"], c.shape, c.chunk_size, len(c.haystack)
    asked = shape.frequent_words
    vocab = [NOISE_WORD] + [_new_word(c) for _ in range(max(asked + 2, length // 50) - 1)]
    question = c.encode(texts["question"].format(count=asked))
    question, answer = _answer_ids(c, question, vocab[1 : 1 + asked])
    answer_start, question_start = question_spot(length, S, len(question), len(answer))
    word_ids = [np.asarray(c.encode(texts["word"].format(word=w)), dtype=np.int64) for w in vocab]
    lens = np.asarray([len(ids) for ids in word_ids])
    share = np.arange(1, len(vocab) + 1, dtype=np.float64) ** -shape.zipf_alpha / _zeta(shape.zipf_alpha)

    def counts(words: int) -> np.ndarray:
        return np.floor(words * share).astype(np.int64)

    low, high = 0, question_start + len(vocab)  # the most words whose list fits before the question
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if int(counts(mid) @ lens) <= question_start else (low, mid - 1)
    drawn = counts(low)
    top = drawn[: asked + 2]  # the noise word, the asked ones and the next: each strictly more frequent
    if len(top) < asked + 2 or not (np.diff(top) < 0).all():
        raise ValueError(
            f"a sequence of {length} tokens holds too few words ({int(drawn.sum())}) for the {asked} most "
            "frequent ones to be told apart; use longer sequences or fewer frequent_words"
        )
    order = c.rng.permutation(np.repeat(np.arange(len(vocab)), drawn))
    tokens = np.concatenate([word_ids[i] for i in order.tolist()])
    owner = np.repeat(order, lens[order])
    asked_at = np.flatnonzero((owner >= 1) & (owner <= asked))
    return _word_list_sample(
        c, "fwe", tokens.tolist(), question, answer, (answer_start, question_start), vocab[1 : 1 + asked], asked_at
    )


def _zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta at ``alpha > 1``: the first ``terms`` terms and the integral of the rest (error below 1e-9
    for alpha >= 2)."""
    k = np.arange(1, terms + 1, dtype=np.float64)
    return float((k**-alpha).sum() + (terms + 0.5) ** (1 - alpha) / (alpha - 1))


def _word_list_sample(
    c: _Context,
    family: str,
    tokens: list[int],
    question: list[int],
    answer: list[int],
    spot: tuple[int, int],
    answers: list[str],
    asked_at: Sequence[int] | np.ndarray,
) -> TaskSample:
    """A ``cwe``/``fwe`` sample: ``tokens`` (the word list) end right before the question, the haystack pads the
    start; ``asked_at``: positions in ``tokens`` of the asked words' tokens."""
    answer_start, question_start = spot
    start = question_start - len(tokens)
    out = c.haystack.copy()
    out[start:question_start] = tokens
    out[question_start:answer_start] = question
    out[answer_start : answer_start + len(answer)] = answer
    S = c.chunk_size
    return TaskSample(
        ids=out,
        family=family,
        answer_start=answer_start,
        answer_len=len(answer),
        needle_start=start,
        needle_len=len(tokens),
        room=start,
        key=ANSWER_SEPARATOR.join(answers),
        answers=tuple(answers),
        asked_chunks=frozenset(int(k) for k in np.unique((start + np.asarray(asked_at, dtype=np.int64)) // S)),
    )


_BUILDERS: dict[str, Callable[[_Context], TaskSample]] = {
    "single": _single,
    "multikey": _multikey,
    "multivalue": _multivalue,
    "multiquery": _multiquery,
    "vt": _vt,
    "multihop": _multihop,
    "cwe": _cwe,
    "fwe": _fwe,
}

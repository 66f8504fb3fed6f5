"""Needle texts and their chunk-grid layout: the passkey needle, the key/value needles and the two-hop chains.

A needle sentence holding a random 5-digit pass key overwrites the haystack (real text) at a depth, and the
question followed by the answer is written near the end. The loss is the plain LM loss over everything, so the
model learns to fetch the key from far back through retrieval.

The layout follows the model's chunks, as the paper's data does: the needle never straddles two chunks, and the
question's last token is the first token of a chunk, so the first answer token is predicted by a chunk whose
retrieval was triggered by the landmark of the chunk holding the question. ``pipeline.data.retrieval_tasks``
builds every task family from these texts, checks and layouts, for the trainer's mix and for the eval alike.

Two-hop chains (family ``multihop``): ``name -> next name -> key`` -- a link needle "A leads to B" and a key
needle for B -- plus distractor chains, each needle alone in its chunk(s). The question names A at the very end
of a chunk and its remaining words fill the next chunk up to the answer's chunk (``place_hop_question``). That is
the layout a second retrieval group needs: the landmark closing A's chunk retrieves the link for the next chunk,
whose landmark, after the first group's layers have read B there, queries the key needle for the answer's chunk.
A single group queries the answer's retrieval from the question's tail alone, which names neither A nor B.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

NEEDLE = " The pass key is {key}. "
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"

TEMPLATED_VARIANTS = ("single", "multikey", "multihop")
"""The task families whose texts are templates a user may replace: ``single`` (one pass-key needle), ``multikey``
(key/value needles with distinct names, one asked for), ``multihop`` (chains ``name -> next name -> key``). The
other families of ``pipeline.data.retrieval_tasks`` have fixed texts."""
HOP_TEMPLATES = {
    "needle": " {name} has pass key {key}. ",
    "link": " {name} leads to {next}. ",
    "question": " Where does {name} lead? The pass key there is",
    "answer": " {key}",
}
"""The two-hop texts, shared by the trainer's needle mix and ``--task passkey variant=multihop``. With the
two-syllable names of ``hop_texts``, each needle fits in 16 tokens (the demo's chunk size) with the demo's
tokenizer, so it lands in one chunk."""
HOP_CHAINS = 2
"""Chains in a two-hop sample: the asked one and one distractor (4 needles, as in the paper's task)."""
SYLLABLES = ("ka", "lo", "mi", "ru", "te", "zo", "ven", "dar", "qui", "sol", "mer", "tav", "xen", "bri", "gol")

TEMPLATES = {
    "single": {"needle": NEEDLE, "question": QUESTION, "answer": ANSWER, "link": ""},
    "multikey": {
        "needle": " One of the special magic numbers for {name} is {key}. ",
        "question": " What is the special magic number for {name}? The special magic number for {name} is",
        "answer": " {key}",
        "link": "",
    },
    "multihop": HOP_TEMPLATES,
}
"""Each variant's default texts (the trainer's mix uses the same ``single`` and ``multihop`` ones)."""
UUID_TEMPLATES = {
    "needle": " One of the special magic uuids for {name} is {key}. ",
    "question": " What is the special magic uuid for {name}? The special magic uuid for {name} is",
}
"""``multikey``'s needle and question when its values are UUIDs (``NeedleSpec.value_kind``; RULER's wording)."""
VALUE_KINDS = ("number", "uuid")
PLACEHOLDERS = {
    "single": {"needle": {"key"}, "question": set(), "answer": {"key"}},
    "multikey": {"needle": {"name", "key"}, "question": {"name"}, "answer": {"key"}},
    "multihop": {"needle": {"name", "key"}, "question": {"name"}, "answer": {"key"}, "link": {"name", "next"}},
}
"""Per variant, the templates it uses and the placeholders each must hold (exactly these): a needle without
``{key}`` hides nothing, an answer without it scores a constant, a question or link without ``{name}`` points
nowhere -- each would give a meaningless score, so they are refused before any work."""


@dataclass
class NeedleSpec:
    """What to hide and ask; ``None`` templates take the variant's default (``TEMPLATES``)."""

    variant: str = "single"
    """passkey: a retrieval task family: single | multikey | multivalue | multiquery | vt | multihop."""
    needle: str | None = None
    """passkey single/multikey/multihop: needle template ({key}; multikey/multihop also {name})."""
    question: str | None = None
    """passkey single/multikey/multihop: question template (multikey/multihop: {name})."""
    answer: str | None = None
    """passkey: answer template ({key})."""
    link: str | None = None
    """passkey multihop: link template ({name}, {next})."""
    needles: int = 4
    """passkey multikey, multiquery: needles in the haystack; multihop: 2 x (needles // 2) in chains."""
    values: int = 3
    """passkey multivalue: values of the asked name, all asked for."""
    queries: int = 2
    """passkey multiquery: needles asked for."""
    hops: int = 2
    """passkey vt: copies after the value in each chain."""
    chains: int = 2
    """passkey vt: chains, the asked one included."""
    key_digits: int = 5
    """passkey: digits of the key."""
    value_kind: str = "number"
    """passkey: the values: number (``key_digits`` digits) | uuid (random UUIDs, 8-4-4-4-12 hex digits, as in
    RULER's niah_single_3; multikey's default texts then say "uuid" where they say "number")."""

    def template(self, part: str) -> str:
        value = getattr(self, part)
        if value is not None:
            return value
        if self.variant == "multikey" and self.value_kind == "uuid" and part in UUID_TEMPLATES:
            return UUID_TEMPLATES[part]
        return TEMPLATES[self.variant][part]


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
        given = [part for part in ("needle", "question", "answer", "link") if getattr(spec, part) is not None]
        if given:
            raise ValueError(
                f"{given[0]}={getattr(spec, given[0])!r}: variant={spec.variant} has fixed texts; the templates "
                f"apply to {', '.join(TEMPLATED_VARIANTS)}"
            )
        return
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


def render(spec: NeedleSpec, part: str, **values: str) -> str:
    """``spec``'s template for ``part`` filled with ``values``.

    Raises:
        ValueError: the template names a placeholder ``values`` lacks.
    """
    text = spec.template(part)
    try:
        return text.format(**values)
    except (KeyError, IndexError) as err:
        raise ValueError(
            f"{part}={text!r}: unknown placeholder {err} for variant={spec.variant} "
            f"(available: {', '.join('{' + k + '}' for k in values)})"
        ) from None


def needle_parts(
    spec: NeedleSpec,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    key: str,
    name: str | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the key-bearing needle, the question and the answer of a ``single`` or ``multikey`` sample
    (``name``: the asked needle's name, ``multikey`` only), the answer's leading whitespace tokens moved into the
    question (``move_answer_whitespace``)."""
    names = {} if name is None else {"name": name}
    needle = encode(render(spec, "needle", **names, key=key))
    question = encode(render(spec, "question", **names))
    question, answer = move_answer_whitespace(question, encode(render(spec, "answer", key=key)), decode)
    return needle, question, answer


def new_name(rng: np.random.Generator, taken: set[str], syllables: int = 3) -> str:
    """A made-up name of ``syllables`` syllables not in ``taken`` (added to it)."""
    while True:
        name = "".join(rng.choice(SYLLABLES, size=syllables)).capitalize()
        if name not in taken:
            taken.add(name)
            return name


def split_question(template: str) -> tuple[str, str]:
    """Cut a question template right after its first ``{name}``: (head ending with the name, tail).

    Raises:
        ValueError: the template has no ``{name}``, or nothing after it (the tail must lead to the answer).
    """
    found = _NAME_FIELD.search(template)
    if found is None:
        raise ValueError(f"question={template!r} lacks {{name}}")
    head, tail = template[: found.end()], template[found.end() :]
    if not tail.strip():
        raise ValueError(f"question={template!r}: needs words after {{name}} that lead to the answer")
    return head, tail


_NAME_FIELD = re.compile(r"(?<!\{)\{name(?:[!:][^{}]*)?\}")


def move_answer_whitespace(
    question: list[int], answer: list[int], decode: Callable[[list[int]], str]
) -> tuple[list[int], list[int]]:
    """Move the answer's leading tokens that decode to pure whitespace (the space before the digits) to the end
    of the question, keeping at least one answer token.

    They are the same for every key, so leaving them in the answer would make its first token trivially
    predictable; after the move the first answer token is the first digit. Returns new lists.
    """
    question, answer = list(question), list(answer)
    while len(answer) > 1 and not decode(answer[:1]).strip():
        question.append(answer.pop(0))
    return question, answer


@dataclass(frozen=True)
class NeedlePlacement:
    needle_start: int
    question_start: int
    answer_start: int
    """The answer's first token; the token before it (the question's last) is the first token of a chunk."""


def place_needle(
    length: int, chunk_size: int, needle_len: int, question_len: int, answer_len: int, depth: float
) -> NeedlePlacement:
    """Chunk-aligned positions for a needle at ``depth`` in [0, 1] of the room before the question.

    Raises:
        ValueError: the sequence cannot hold the needle, the question and the answer.
    """
    S = chunk_size
    answer_start = (length - answer_len - 1) // S * S + 1  # the last chunk start that leaves room for the answer
    question_start = answer_start - question_len
    room = question_start - needle_len  # latest possible needle start
    if question_start < 0 or room < 0:
        raise ValueError(
            f"a sequence of {length} tokens cannot hold a passkey needle ({needle_len} tokens), question "
            f"({question_len}) and answer ({answer_len}) with chunk_size={S}"
        )
    start = _needle_start(depth, room, S, needle_len)
    return NeedlePlacement(needle_start=start, question_start=question_start, answer_start=answer_start)


def lay_out_needle(
    seq: np.ndarray,
    needle: Sequence[int],
    question: Sequence[int],
    answer: Sequence[int],
    *,
    depth: float,
    chunk_size: int,
    others: Sequence[Sequence[int]] = (),
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, NeedlePlacement]:
    """A copy of ``seq`` with a ``single``/``multikey`` sample written over it: ``needle`` at ``depth``
    (``place_needle``), ``others`` (distractor needles) at random spots from ``rng`` before the question, touching
    neither each other nor the needle, then the question and the answer.

    Raises:
        ValueError: the sequence cannot hold them all.
    """
    length = len(seq)
    where = place_needle(length, chunk_size, len(needle), len(question), len(answer), depth)
    out = seq.copy()
    taken = [(where.needle_start, where.needle_start + len(needle)), (where.question_start, length)]
    for other in others:
        assert rng is not None, "distractor needles need an rng for their spots"
        for _ in range(1000):
            at = int(rng.integers(0, max(where.question_start - len(other), 0) + 1))
            if at + len(other) <= where.question_start and all(at + len(other) <= lo or at >= hi for lo, hi in taken):
                break
        else:
            raise ValueError(
                f"length={length} is too short to place {len(others) + 1} needles without overlap; use longer "
                "lengths or fewer needles"
            )
        out[at : at + len(other)] = other
        taken.append((at, at + len(other)))
    out[where.needle_start : where.needle_start + len(needle)] = needle
    out[where.question_start : where.answer_start] = question
    out[where.answer_start : where.answer_start + len(answer)] = answer
    return out, where


def _needle_start(depth: float, room: int, chunk_size: int, needle_len: int) -> int:
    """``round(depth * room)``, shifted left so that a needle that fits in a chunk ends with it, never straddles."""
    S = chunk_size
    start = int(round(depth * room))
    if needle_len <= S and start % S + needle_len > S:
        start = start // S * S + S - needle_len
    return start


@dataclass
class HopTexts:
    """Token ids of one two-hop sample's parts."""

    needle: list[int]
    """The asked chain's key needle (its ``next`` name and the key)."""
    link: list[int]
    """The asked chain's link: the question's name leads to the key needle's name."""
    distractors: list[list[int]] = field(default_factory=list)
    """The other chains' links and key needles."""
    head: list[int] = field(default_factory=list)
    """The question up to and including the name."""
    tail: list[int] = field(default_factory=list)
    """The rest of the question (ends with the answer's leading whitespace, ``move_answer_whitespace``)."""
    answer: list[int] = field(default_factory=list)


def hop_texts(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    templates: dict[str, str],
    key: str,
    new_key: Callable[[], str],
    rng: np.random.Generator,
    chains: int = HOP_CHAINS,
) -> HopTexts:
    """The parts of a two-hop sample asking for ``key``: ``chains - 1`` distractor chains with keys from
    ``new_key``, names from ``rng``. ``templates`` holds ``needle``, ``link``, ``question``, ``answer``."""
    names: set[str] = set()
    start, middle = new_name(rng, names, 2), new_name(rng, names, 2)
    distractors = []
    for _ in range(chains - 1):
        other_start, other_end = new_name(rng, names, 2), new_name(rng, names, 2)
        distractors += [
            encode(templates["link"].format(name=other_start, next=other_end)),
            encode(templates["needle"].format(name=other_end, key=new_key())),
        ]
    head, tail = split_question(templates["question"])
    tail_ids, answer = move_answer_whitespace(
        encode(tail.format(name=start)), encode(templates["answer"].format(key=key)), decode
    )
    return HopTexts(
        needle=encode(templates["needle"].format(name=middle, key=key)),
        link=encode(templates["link"].format(name=start, next=middle)),
        distractors=distractors,
        head=encode(head.format(name=start)),
        tail=tail_ids,
        answer=answer,
    )


@dataclass(frozen=True)
class HopPlacement:
    needle_start: int
    """The asked chain's key needle."""
    room: int
    """Its latest possible start (it ends before the question's first chunk); depth d puts it at
    ``round(d * room)``."""
    question_start: int
    """The question's head, which ends with the last token of the chunk two before the answer's."""
    tail_start: int
    answer_start: int
    """As in ``NeedlePlacement``: the token before it (the tail's last) is the first token of a chunk."""
    others: tuple[int, ...]
    """Starts of the link and the distractors, in ``HopTexts`` order (link first)."""


@dataclass(frozen=True)
class HopChunks:
    """Chunk ids of a two-hop sample's parts: what each retrieval should bring for the hops to be followed."""

    answer: int
    """``c``, the chunk whose tokens predict the answer's first token; they read the row of landmark ``c - 1``, and
    the question's name ends chunk ``c - 2`` (its landmark's row is the first hop)."""
    link: frozenset[int]
    key: frozenset[int]
    distractor_links: frozenset[int]
    distractor_keys: frozenset[int]

    @staticmethod
    def of(where: HopPlacement, texts: HopTexts, chunk_size: int) -> HopChunks:
        S = chunk_size
        parts = list(zip(where.others[1:], texts.distractors))
        return HopChunks(
            answer=(where.answer_start - 1) // S,
            link=frozenset(chunks_of(where.others[0], len(texts.link), S)),
            key=frozenset(chunks_of(where.needle_start, len(texts.needle), S)),
            distractor_links=frozenset(c for at, part in parts[0::2] for c in chunks_of(at, len(part), S)),
            distractor_keys=frozenset(c for at, part in parts[1::2] for c in chunks_of(at, len(part), S)),
        )

    def followed(self, picks: dict[tuple[int, int], list[list[int]]]) -> dict[str, dict[str, bool]]:
        """Per group ``g<i>``, from ``StreamState.picks`` (batch row 0): ``first_hop_link`` -- the row of landmark
        ``c - 2`` (right after the name) holds the link; ``first_hop_distractor_link`` -- it holds another chain's
        link (a retriever that learned which kind of chunk to fetch but not by which name); ``second_hop_key`` --
        the row of landmark ``c - 1`` (read by the answer's chunk) holds the asked key needle;
        ``second_hop_distractor_key`` -- it holds another chain's key needle. A row never scored (the prefix
        skipped it) gives no entry."""
        out: dict[str, dict[str, bool]] = {}
        for g in sorted({group for group, _ in picks}):
            hops: dict[str, bool] = {}
            first = picks.get((g, self.answer - 2))
            if first is not None:
                hops["first_hop_link"] = bool(self.link & set(first[0]))
                hops["first_hop_distractor_link"] = bool(self.distractor_links & set(first[0]))
            second = picks.get((g, self.answer - 1))
            if second is not None:
                hops["second_hop_key"] = bool(self.key & set(second[0]))
                hops["second_hop_distractor_key"] = bool(self.distractor_keys & set(second[0]))
            out[f"g{g}"] = hops
        return out


def place_hop_question(
    length: int, chunk_size: int, head_len: int, tail_len: int, answer_len: int
) -> tuple[int, int, int]:
    """(head start, tail start, answer start) of a two-hop question: the answer's chunk ``c`` as in
    ``place_needle``, the tail ending with the first token of ``c``, the head (ending with the name) ending with
    chunk ``c - 2``; haystack fills the gap between them.

    Raises:
        ValueError: the tail is longer than a chunk plus one token (the head would end in an earlier chunk), or
            the sequence is too short.
    """
    S = chunk_size
    if tail_len > S + 1:
        raise ValueError(
            f"the two-hop question's words after the name take {tail_len} tokens; with chunk_size={S} at most "
            f"{S + 1} fit between the name's chunk and the answer: shorten the question after {{name}}"
        )
    answer_start = (length - answer_len - 1) // S * S + 1
    head_end = answer_start - 1 - S
    return head_end - head_len, answer_start - tail_len, answer_start


def lay_out_multihop(
    seq: np.ndarray, texts: HopTexts, chunk_size: int, depth: float, rng: np.random.Generator
) -> tuple[np.ndarray, HopPlacement]:
    """A copy of ``seq`` with a two-hop sample written over it: the asked key needle at ``depth`` of the room
    before the question, the link and the distractors at random spots of their own, every needle in chunks no
    other needle or the question touches (one retrieval can then never bring two of them).

    Raises:
        ValueError: the sequence cannot hold every part that way.
    """
    S, length = chunk_size, len(seq)
    question_start, tail_start, answer_start = place_hop_question(
        length, S, len(texts.head), len(texts.tail), len(texts.answer)
    )
    room = question_start // S * S - len(texts.needle)  # the key needle ends before the question's first chunk
    if question_start < 0 or room < 0:
        raise ValueError(
            f"a sequence of {length} tokens cannot hold a two-hop question ({len(texts.head)} + "
            f"{len(texts.tail)} tokens), its key needle ({len(texts.needle)}) and answer ({len(texts.answer)}) "
            f"with chunk_size={S}"
        )
    needle_start = in_chunk_at(depth, room, S, len(texts.needle), rng)
    busy = chunks_of(needle_start, len(texts.needle), S) | set(range(question_start // S, -(-length // S)))
    others = []
    for part in [texts.link, *texts.distractors]:
        at = free_spot(len(part), question_start, busy, S, rng)
        if at is None:
            raise ValueError(
                f"a sequence of {length} tokens with chunk_size={S} has too few free chunks before the question "
                f"for {2 + len(texts.distractors)} two-hop needles, each in chunks of its own; use longer sequences"
            )
        busy |= chunks_of(at, len(part), S)
        others.append(at)
    out = seq.copy()
    for at, part in zip([needle_start, *others], [texts.needle, texts.link, *texts.distractors]):
        out[at : at + len(part)] = part
    out[question_start : question_start + len(texts.head)] = texts.head
    out[tail_start:answer_start] = texts.tail
    out[answer_start : answer_start + len(texts.answer)] = texts.answer
    return out, HopPlacement(needle_start, room, question_start, tail_start, answer_start, tuple(others))


def in_chunk_at(depth: float, room: int, chunk_size: int, needle_len: int, rng: np.random.Generator) -> int:
    """A start in the chunk holding ``round(depth * room)``, at a random offset that keeps a needle that fits in
    a chunk inside it (as ``free_spot`` places the other needles). Shifting it to end with its chunk instead,
    as ``place_needle`` does, made the asked needle end its chunk far more often than the distractors, and the
    retriever learned to pick the needle that ends its chunk instead of following the link.

    A needle longer than a chunk ends with a chunk (less than a chunk after ``round(depth * room)``), as
    ``free_spot`` places every such needle: its last chunk then holds the key together with the words right
    before it (a RULER needle's name), so the chunk that must be retrieved says whose key it is. At a random
    offset the key's chunk often held no part of the name, and no retriever could tell the asked needle's key
    chunk from a distractor's."""
    S = chunk_size
    at = int(round(depth * room))
    if needle_len > S:
        end = -(-(at + needle_len) // S) * S
        return end - needle_len if end - needle_len <= room else at
    lo = at // S * S
    return lo + int(rng.integers(0, min(S - needle_len, room - lo) + 1))


def chunks_of(start: int, n: int, chunk_size: int) -> set[int]:
    return set(range(start // chunk_size, (start + n - 1) // chunk_size + 1))


def free_spot(n: int, limit: int, busy: set[int], chunk_size: int, rng: np.random.Generator) -> int | None:
    """A random start for ``n`` tokens ending by ``limit`` in chunks not ``busy``, uniform over the free runs of
    chunks that hold it (a needle that fits in a chunk gets one chunk, never straddles two; one longer than a
    chunk ends with its last chunk, as ``in_chunk_at`` places it); ``None`` when the sequence has no such run."""
    S = chunk_size
    span = -(-n // S)  # chunks it needs when it starts on a chunk boundary
    slack = span * S - n  # positions it can move right within those chunks
    if n > S:
        starts = [k for k in range(limit // S) if (k + span) * S <= limit and not busy & set(range(k, k + span))]
        return int(rng.choice(starts)) * S + slack if starts else None
    starts = [k for k in range(limit // S) if (k + span) * S - slack <= limit and not busy & set(range(k, k + span))]
    if not starts:
        return None
    k = int(rng.choice(starts))
    return k * S + int(rng.integers(0, min(slack, limit - k * S - n) + 1))

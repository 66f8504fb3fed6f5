"""Why a RULER needle answer is wrong (``--task ruler``; docs/evaluation.md, "Why an answer is wrong").

Every wrong sample of a needle task gets one ``error`` kind, from its retrieval checks
(``passkey.retrieval_checks``) and its prediction:

- ``retrieval_miss``: the question's row did not fetch the asked needle (every asked needle, for a task that asks for
  several) in any retrieval group;
- ``later_miss``: it did, but a row read by the answer's later chunks did not;
- otherwise a copy error, the needles fetched at every row: ``splice`` (a written value is the start of one asked
  value joined to the end of another: ``55236`` from ``55291`` and ``45236``), ``repeat`` (an asked value written
  twice while another is missing) or ``miscopy`` (anything else).

A one-value answer also records how far the copy went right (``copy``): greedy decoding feeds back the model's own
tokens, so every token up to the first wrong one was predicted after a correct prefix, as teacher forcing would
predict it. Counted per kind of token (``token_kind``), over a task's samples, that is the accuracy of copying each
kind -- a hex UUID is written in digits, single letters and letter pairs the tokenizer merged (``ab``, ``df``), and
the kind that fails is the kind the training lacks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

ERROR_KINDS = ("retrieval_miss", "later_miss", "splice", "repeat", "miscopy")
TOKEN_KINDS = ("space", "digit", "letter", "piece", "punct")
"""``space``: opens with whitespace (an answer's first token, when the value starts with a letter); ``digit`` and
``letter``: one character; ``piece``: several letters or digits merged into one token; ``punct``: the rest."""

_VALUE = re.compile(r"[0-9a-z]+(?:-[0-9a-z]+)*")


def token_kind(piece: str) -> str:
    """The kind of a token from its text (``TOKEN_KINDS``)."""
    if piece[:1].isspace():
        return "space"
    if len(piece) == 1 and piece.isdigit():
        return "digit"
    if len(piece) == 1 and piece.isalpha():
        return "letter"
    if len(piece) > 1 and piece.isalnum():
        return "piece"
    return "punct"


def copy_trace(expected: list[int], predicted: list[int], decode: Callable[[list[int]], str]) -> dict:
    """How far ``predicted`` copies ``expected`` (token ids): ``{"reached": {kind: tokens}, "first_wrong": {"at",
    "kind", "expected", "predicted"} or None}``, ``reached`` counting every token predicted after a correct prefix
    (the first wrong one included)."""
    reached: dict[str, int] = {}
    for at, want in enumerate(expected):
        kind = token_kind(decode([want]))
        reached[kind] = reached.get(kind, 0) + 1
        got = predicted[at] if at < len(predicted) else None
        if got != want:
            wrong = {
                "at": at,
                "kind": kind,
                "expected": decode([want]),
                "predicted": "" if got is None else decode([got]),
            }
            return {"reached": reached, "first_wrong": wrong}
    return {"reached": reached, "first_wrong": None}


SPLICE_PART = 2
"""Characters each part of a splice has at least: a one-character end matches another value by chance too often
(a random last digit ends one of three other 5-digit values in ~27% of samples)."""


def _splices(value: str, answers: list[str]) -> bool:
    """``value`` is a start of one answer followed by an end of another, each part ``SPLICE_PART`` characters or
    more."""
    return any(
        value[:cut] == a[:cut] and b.endswith(value[cut:])
        for cut in range(SPLICE_PART, len(value) - SPLICE_PART + 1)
        for a in answers
        for b in answers
        if a != b
    )


def classify(retrieval: dict[str, dict[str, bool]], prediction: str, answers: Iterable[str]) -> str | None:
    """The ``ERROR_KINDS`` entry of a needle sample (``retrieval``: its checks), or ``None`` when every answer is in
    ``prediction`` or the sample has no needle checks (word lists, QA, two hops)."""
    answers = [a.lower() for a in answers]
    text = prediction.lower()
    if all(a in text for a in answers) or not any("asked_needle" in g for g in retrieval.values()):
        return None
    if not any(g.get("every_asked_needle", g.get("asked_needle")) for g in retrieval.values()):
        return "retrieval_miss"
    if any(g.get("every_asked_needle_later") is False for g in retrieval.values()):
        return "later_miss"
    values = _VALUE.findall(text)
    if any(v not in answers and _splices(v, answers) for v in values):
        return "splice"
    if any(values.count(a) > 1 for a in answers):
        return "repeat"
    return "miscopy"


def summarize(records: list[dict]) -> dict:
    """A RULER row's error fields over its sample ``records``: ``errors`` ({kind: samples}, the classified wrong
    samples) and ``copy_by_kind`` ({token kind: {"right", "n"}} over the one-value answers' ``copy`` traces);
    each present only when some record has it."""
    out: dict = {}
    errors = [r["error"] for r in records if r.get("error")]
    if errors:
        out["errors"] = {kind: errors.count(kind) for kind in ERROR_KINDS if kind in errors}
    traces = [r["copy"] for r in records if "copy" in r]
    if traces:
        by_kind: dict[str, dict[str, int]] = {}
        for trace in traces:
            wrong = trace["first_wrong"]
            for kind, n in trace["reached"].items():
                count = by_kind.setdefault(kind, {"right": 0, "n": 0})
                count["n"] += n
                count["right"] += n - int(wrong is not None and wrong["kind"] == kind)
        out["copy_by_kind"] = {kind: by_kind[kind] for kind in TOKEN_KINDS if kind in by_kind}
    return out

"""Why a RULER answer is wrong: error kinds on hand-made predictions, copy traces against a token-by-token reading,
and the rows of a RULER run counting both."""

from __future__ import annotations

import pytest

from pipeline.evaluation import ruler
from pipeline.evaluation.answer_errors import ERROR_KINDS, classify, copy_trace, summarize, token_kind
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.tokenizer import ByteTokenizer

FETCHED_ALL = {"g0": {"asked_needle": True, "every_asked_needle": True, "every_asked_needle_later": True}}
ANSWERS = ("55291", "45236", "17707", "28613")


@pytest.mark.parametrize(
    ("piece", "kind"),
    [
        (" c", "space"),
        ("\u2581", "punct"),
        ("7", "digit"),
        ("f", "letter"),
        ("df", "piece"),
        ("a3", "piece"),
        ("-", "punct"),
        (".", "punct"),
    ],
)
def test_token_kinds(piece, kind):
    assert token_kind(piece) == kind


def test_copy_trace_counts_the_tokens_up_to_the_first_wrong_one():
    pieces = {1: " c", 2: "3", 3: "df", 4: "-", 5: "e", 6: "4", 9: "x"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    expected = [1, 2, 3, 4, 5, 6]
    right = copy_trace(expected, list(expected), decode)
    assert right == {"reached": {"space": 1, "digit": 2, "piece": 1, "punct": 1, "letter": 1}, "first_wrong": None}
    wrong = copy_trace(expected, [1, 2, 5, 4, 5, 6], decode)  # "df" written as "e": tokens after it are not counted
    assert wrong["reached"] == {"space": 1, "digit": 1, "piece": 1}
    assert wrong["first_wrong"] == {"at": 2, "kind": "piece", "expected": "df", "predicted": "e"}
    short = copy_trace(expected, [1], decode)  # a prediction that stops early is wrong where it stops
    assert short["first_wrong"] == {"at": 1, "kind": "digit", "expected": "3", "predicted": ""}


@pytest.mark.parametrize(
    ("retrieval", "prediction", "kind"),
    [
        (FETCHED_ALL, "55291, 45236, 17707, 28613", None),
        (FETCHED_ALL, "28613, 17707, 45236, 55291 and more", None),  # any order, extra text allowed
        ({"g0": {"asked_needle": True, "every_asked_needle": False}}, "55291, 1, 2, 3", "retrieval_miss"),
        ({"g0": {"asked_needle": False}, "g1": {"asked_needle": False}}, "nothing", "retrieval_miss"),
        (
            {"g0": {"asked_needle": True, "every_asked_needle": True, "every_asked_needle_later": False}},
            "x",
            "later_miss",
        ),
        (FETCHED_ALL, "55236, 45291, 17707, 28613", "splice"),  # 552|36 and 452|91
        (FETCHED_ALL, "55291, 45236, 17707, 17707", "repeat"),
        (FETCHED_ALL, "55291, 45236, 17707, 99999", "miscopy"),
        (FETCHED_ALL, "55293, 45236, 17707, 28613", "miscopy"),  # 5529|3: a one-digit end is no splice
        ({}, "nothing", None),  # no needle checks (a word list, a model without retrieval): not classified
    ],
)
def test_error_kinds(retrieval, prediction, kind):
    assert classify(retrieval, prediction, ANSWERS) == kind


def test_a_one_value_answer_one_character_off_is_a_miscopy_and_a_uuid_splices_nothing():
    uuid = "c3fdeea3-2b6b-4ef8-b4d3-6b17aa4d7d7c"
    assert classify({"g0": {"asked_needle": True}}, "c3feea33-2b6b-4d6b-b4d-6b17d7d7d7", [uuid]) == "miscopy"
    assert classify({"g0": {"asked_needle": True}}, uuid.upper(), [uuid]) is None  # RULER's match is case-blind


def test_summary_counts_errors_and_right_tokens_per_kind():
    records = [
        {"error": "splice"},
        {"error": "splice"},
        {"error": "miscopy", "copy": {"reached": {"digit": 3, "piece": 1}, "first_wrong": {"kind": "piece"}}},
        {"copy": {"reached": {"digit": 5, "letter": 2}, "first_wrong": None}},
        {},
    ]
    assert summarize(records) == {
        "errors": {"splice": 2, "miscopy": 1},
        "copy_by_kind": {"digit": {"right": 8, "n": 8}, "letter": {"right": 2, "n": 2}, "piece": {"right": 0, "n": 1}},
    }
    assert summarize([{}, {}]) == {}


def test_ruler_records_and_rows_say_why_each_answer_is_wrong(tiny_model, monkeypatch):
    """Predictions made by hand over real samples (``niah_multivalue``: a splice of two asked values, then all four;
    ``niah_single_2``: the key with its last digit changed, then the key), the retrieval checks set to "every
    needle fetched": each record's ``error`` and ``copy`` and the rows' counts follow from the predictions."""
    tok = ByteTokenizer()
    sources = {"data": TokenSource("builtin", tok, 0), "noise": TokenSource("noise", tok, 0)}
    grid = ruler.RulerGrid(["niah_multivalue", "niah_single_2"], [1024], 2, seed=0)
    calls: list[str] = []

    def predict(model, sample, **kwargs):
        answers = list(sample.answers)
        if len(answers) > 1:
            a, b = answers[0], answers[1]
            text = ", ".join([a[:2] + b[2:], b, *answers[2:]]) if not calls else ", ".join(answers)
        else:
            key = answers[0]
            text = key[:-1] + ("0" if key[-1] != "0" else "1") if len(calls) == 2 else key
        calls.append(text)
        return tok.encode(text)

    def checks(sample, picks, chunk_size):
        fetched = {"asked_needle": True}
        return {"g0": {**fetched, "every_asked_needle": True} if len(sample.answers) > 1 else fetched}

    monkeypatch.setattr(ruler, "predict_answer", predict)
    monkeypatch.setattr(ruler, "retrieval_checks", checks)
    rows = {r["task"]: r for r in ruler.evaluate_ruler(tiny_model, tok, sources, grid)}
    assert rows["niah_multivalue"]["errors"] == {"splice": 1}
    assert "copy_by_kind" not in rows["niah_multivalue"]  # the order of several values is free: no token trace
    assert rows["niah_single_2"]["errors"] == {"miscopy": 1}
    # Both keys have 5 digits (key_digits), after the answer's leading space token moved into the question: the
    # wrong key's first four digits are right and its fifth is not.
    assert rows["niah_single_2"]["copy_by_kind"] == {"digit": {"right": 9, "n": 10}}
    table = ruler.errors_table(list(rows.values())).splitlines()
    assert table[0] == "| task | length | wrong | " + " | ".join(ERROR_KINDS) + " | digit right |"
    assert table[2:] == [
        "| niah_multivalue | 1K | 1/2 | 0 | 0 | 1 | 0 | 0 | - |",
        "| niah_single_2 | 1K | 1/2 | 0 | 0 | 0 | 0 | 1 | 9/10 |",
    ]
    assert ruler.errors_table([{**r, "errors": {}} for r in rows.values()]) == ""  # nothing wrong: no table

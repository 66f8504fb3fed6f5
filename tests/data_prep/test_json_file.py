"""The one reader of JSON files the tools read back: bounded, typed, one line naming the file and the field."""

import json
import os

import pytest

from data_prep.json_file import Fields, JsonFileError, parse_json, read_json, summarize


def test_parse_matches_json_module_on_ordinary_files():
    obj = {"a": "[[{{ in a string", "b": [1, 2.5, {"c": None, "d": True}], "e": '\\"['}
    raw = json.dumps(obj).encode()
    assert parse_json(raw, "f.json") == json.loads(raw)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"[" * 200_000 + b"]" * 200_000, "nested 200000 deep"),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": 1e999}', "out of range"),
        (b"\xff{}", "utf-8"),
        (b'{"a": ', "not valid JSON"),
    ],
)
def test_hostile_bytes_are_one_line_naming_the_file(raw, reason):
    with pytest.raises(JsonFileError) as err:
        parse_json(raw, "run/x.json")
    assert str(err.value).startswith("run/x.json: ") and reason in str(err.value) and "\n" not in str(err.value)


def test_depth_counts_brackets_outside_strings_only():
    deep_in_string = json.dumps({"s": "[" * 1000})
    assert parse_json(deep_in_string, "f")["s"] == "[" * 1000
    with pytest.raises(JsonFileError, match="nested 3 deep"):
        parse_json("[[[1]]]", "f", max_depth=2)


def test_read_json_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(JsonFileError, match="not a regular file"):
        read_json(fifo)
    with pytest.raises(JsonFileError, match="a directory"):
        read_json(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")
    big = tmp_path / "big.json"
    big.write_text(json.dumps(list(range(1000))))
    with pytest.raises(JsonFileError, match="more than the 100 read"):
        read_json(big, max_bytes=100)
    assert read_json(big) == list(range(1000))


@pytest.mark.parametrize(
    ("obj", "call", "message"),
    [
        (
            {"step": 10**30},
            lambda f: f.integer("step", low=0, high=10**12),
            "'step' is 1000000000000000000000000000000",
        ),
        ({"step": -3}, lambda f: f.integer("step", low=0), "expected an integer in [0, inf]"),
        ({"step": "4"}, lambda f: f.integer("step"), "'step' is \"4\", expected an integer"),
        ({"step": True}, lambda f: f.integer("step"), "'step' is true"),
        ({"step": 4.0}, lambda f: f.integer("step"), "'step' is 4.0"),
        ({"parallel": None}, lambda f: f.mapping("parallel"), "'parallel' is null, expected an object"),
        ({"files": []}, lambda f: f.mapping("files"), "'files' is [], expected an object"),
        ({}, lambda f: f.string("format"), "'format' is missing"),
        ({"lr": float("nan")}, lambda f: f.number("lr"), "'lr' is NaN"),
        ({"kind": "x"}, lambda f: f.string("kind", choices=["a", "b"]), "expected one of a, b"),
        ({"p": {"dp": "2"}}, lambda f: f.nested("p").integer("dp"), "'p.dp' is \"2\""),
    ],
)
def test_fields_name_the_file_the_field_and_the_value(obj, call, message):
    with pytest.raises(JsonFileError) as err:
        call(Fields(obj, "ckpt/trainer_state.json"))
    assert str(err.value).startswith("ckpt/trainer_state.json: ") and message in str(err.value)


def test_fields_return_values_and_defaults():
    fields = Fields({"step": 4, "name": "a", "ok": False, "m": {}, "l": [1], "x": 0.5}, "f")
    assert fields.integer("step", low=0, high=4) == 4
    assert fields.string("name") == "a" and fields.boolean("ok") is False
    assert fields.mapping("m") == {} and fields.sequence("l") == [1] and fields.number("x", low=0, high=1) == 0.5
    assert fields.integer("absent", default=None) is None
    with pytest.raises(JsonFileError, match="the file is a list, expected an object"):
        Fields([], "f")


def test_summarize_caps_long_lists():
    assert summarize(["a", "b"]) == "a, b"
    text = summarize([f"n{i}" for i in range(20_000)])
    assert text.endswith("... and 19,990 more") and text.startswith("n0, n1") and len(text) < 120


def test_reading_a_small_file_allocates_about_its_size_not_the_limit(tmp_path):
    """Python's ``read(n)`` allocates ``n`` bytes before it reads: asking for the 256 MiB limit plus one made every
    JSON, index and tokenizer read allocate 256 MiB (counted by ``ulimit -v``), whatever the file's size."""
    import tracemalloc
    from pathlib import Path

    from data_prep.safe_files import read_followed, read_regular

    path = tmp_path / "small.json"
    path.write_text('{"a": 1}')
    tracemalloc.start()
    try:
        for read in (lambda: read_json(path), lambda: read_regular(tmp_path, "small.json", max_size=1 << 28)):
            tracemalloc.reset_peak()
            read()
            assert tracemalloc.get_traced_memory()[1] < 1 << 20
        tracemalloc.reset_peak()
        read_followed(Path(path))
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()

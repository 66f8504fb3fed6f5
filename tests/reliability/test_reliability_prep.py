"""T12 (data-prep bad input) and T13 (data-prep atomicity, and the trainer's refusal of incomplete outputs).

tests/data_prep covers each bad-input kind and the SIGKILLed prep run in detail; these tests hold the catalogue's
pass criteria together in one place, and add the trainer side: it never trains on an interrupted prep output.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from reliability_harness import overrides

from data_prep.config import load_config
from data_prep.errors import InputError, OutputExistsError
from data_prep.format import COMPLETE_MARKER, MANIFEST_FILENAME, read_manifest
from data_prep.shard import _WORK_MARKER
from data_prep.shard import main as prep
from data_prep.streaming_compat import ensure_streaming_importable
from pipeline.train.trainer import main as train

pytestmark = pytest.mark.reliability

GOOD = [
    "first good document with some words in it",
    "second good one\nover two lines",
    "before\x00after: a NUL byte is text like any other",
    "duplicate id, first text",
    "duplicate id, second text",
]


def _prep(output: Path, inputs: list[Path], **extra: object) -> object:
    settings = {"tokenizer.vocab_size": 300, "val_fraction": 0.0, "progress": "false", **extra}
    args = [
        f"output={output}",
        f"input={json.dumps([str(p) for p in inputs])}",
        *(f"{k}={v}" for k, v in settings.items()),
    ]
    return prep(load_config(None, args))


def _documents(split_dir: Path, cache: Path) -> dict[int, list[int]]:
    ensure_streaming_importable()
    from streaming import StreamingDataset

    ds = StreamingDataset(remote=str(split_dir), local=str(cache), shuffle=False, batch_size=1, validate_hash="xxh64")
    docs: dict[int, list[int]] = {}
    for i in range(len(ds)):
        docs.setdefault(int(ds[i]["doc_id"]), []).extend(ds[i]["tokens"].tolist())
    return docs


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    root = tmp_path / "messy"
    root.mkdir()
    (root / "a_ok.txt").write_text(GOOD[0])
    (root / "b_empty.txt").write_text("")
    (root / "c_whitespace.txt").write_text("  \n\t\n")
    (root / "d_utf16.txt").write_bytes("a UTF-16 file".encode("utf-16"))
    (root / "e_nul.txt").write_text(GOOD[2])
    (root / "f_records.jsonl").write_bytes(
        b"\n".join(
            [
                json.dumps({"text": GOOD[1]}).encode(),
                b'{"text": "unterminated',  # line 2: malformed JSON
                json.dumps({"body": "no text field"}).encode(),  # line 3
                json.dumps({"text": 123}).encode(),  # line 4: not a string
                b'{"text": "bad \xff byte"}',  # line 5: not UTF-8
                json.dumps({"id": 7, "text": GOOD[3]}).encode(),
                json.dumps({"id": 7, "text": GOOD[4]}).encode(),  # the same id: ids are ours, not the input's
            ]
        )
        + b"\n"
    )
    return root


def test_t12_bad_input_is_skipped_counted_located_and_round_trips(messy, tmp_path, caplog):
    manifest = _prep(tmp_path / "out", [messy])
    assert manifest.skipped == {
        "empty": 2,
        "malformed_json": 1,
        "missing_field": 1,
        "bad_field_type": 1,
        "non_utf8": 2,
    }, "every skip is counted by reason in the manifest"
    assert read_manifest(tmp_path / "out").skipped == manifest.skipped
    for where in ("f_records.jsonl:2", "f_records.jsonl:3", "f_records.jsonl:4", "f_records.jsonl:5", "d_utf16.txt"):
        assert where in caplog.text, f"{where} is named in a warning"
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    docs = _documents(tmp_path / "out" / "train", tmp_path / "cache")
    assert sorted(sp.decode(t) for t in docs.values()) == sorted(GOOD), "decode(encode(x)) == x (identity normalizer)"
    assert len(docs) == len(GOOD), "both documents with a duplicate input id are kept, with distinct doc ids"


def test_t12_schema_errors_and_empty_input_are_typed_errors(messy, tmp_path):
    with pytest.raises(InputError, match=r"f_records\.jsonl:2: malformed json"):
        _prep(tmp_path / "strict", [messy / "f_records.jsonl"], strict="true")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(InputError, match="matched no"):
        _prep(tmp_path / "none", [tmp_path / "nothing"])
    assert not (tmp_path / "strict").exists() and not (tmp_path / "none").exists()


def test_t12_a_lone_surrogate_escape_is_skipped_as_non_utf8_and_strict_names_the_line(tmp_path, caplog):
    """``"\\ud800"`` is valid JSON but no UTF-8 text: such a line is skipped and counted like undecodable bytes (a
    surrogate pair, which is one real character, is kept); ``strict=true`` names file and line."""
    records = tmp_path / "in" / "records.jsonl"
    records.parent.mkdir()
    records.write_bytes(
        b"\n".join(
            [
                json.dumps({"text": GOOD[0]}).encode(),
                b'{"text": "a\\ud800b"}',  # line 2: a lone high surrogate
                json.dumps({"text": "a pair \U0001f600 is one character"}).encode(),  # escaped as \ud83d\ude00
                b'{"text": "x\\uDC00"}',  # line 4: a lone low surrogate, upper-case escape
            ]
        )
        + b"\n"
    )
    assert b"\\ud83d\\ude00" in records.read_bytes()
    manifest = _prep(tmp_path / "out", [records.parent])
    assert manifest.skipped == {"non_utf8": 2}
    for where in ("records.jsonl:2", "records.jsonl:4"):
        assert where in caplog.text
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    docs = _documents(tmp_path / "out" / "train", tmp_path / "cache")
    assert sorted(sp.decode(t) for t in docs.values()) == sorted([GOOD[0], "a pair \U0001f600 is one character"])
    with pytest.raises(InputError, match=r"records\.jsonl:2: non utf8: .*strict=true"):
        _prep(tmp_path / "strict", [records], strict="true")
    assert not (tmp_path / "strict").exists()


@pytest.mark.slow
def test_t12_five_megabyte_document_is_chunked_exactly(tmp_path):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    text = " ".join(rng.choice(words) for _ in range(880_000))
    assert len(text.encode()) > 5_000_000
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "big.txt").write_text(text)
    manifest = _prep(tmp_path / "out", [tmp_path / "big"], max_piece_tokens=4096)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    docs = _documents(tmp_path / "out" / "train", tmp_path / "cache")
    expected = sp.encode(text)
    assert list(docs) == [0] and docs[0] == expected
    assert manifest.splits["train"].tokens == len(expected)
    assert manifest.splits["train"].pieces == -(-len(expected) // 4096)


def _dead_pid() -> int:
    """The pid of a process that has exited (a fixed number could belong to a live process on the CI machine)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def refused(caplog, reason: str, args: list[str]) -> None:
    """The trainer stops with exit code 2 and one error line giving ``reason``."""
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert train(None, args) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and reason in errors[0] and "\n" not in errors[0], errors


def test_t13_trainer_refuses_incomplete_prep_outputs_and_prep_refuses_to_overwrite(data, tmp_path, caplog):
    """A prep killed mid-way leaves only ``.<out>.tmp-<pid>`` (no ``_COMPLETE``; tests/data_prep kills a real one);
    the trainer refuses it, refuses a dataset whose marker is missing or does not match its manifest (the
    manifest holds the prep arguments and the input list), and prep refuses to write over a finished output."""
    leftover = tmp_path / f".out.tmp-{_dead_pid()}"
    shutil.copytree(data, leftover)
    (leftover / COMPLETE_MARKER).unlink()
    (leftover / MANIFEST_FILENAME).unlink()
    (leftover / _WORK_MARKER).touch()  # every work directory prep creates carries it
    unmarked = Path(shutil.copytree(leftover, tmp_path / f".out.tmp-{_dead_pid()}"))
    (unmarked / _WORK_MARKER).unlink()
    refused(caplog, "interrupted data-prep run", overrides(tmp_path / "run1", leftover))
    no_marker = Path(shutil.copytree(data, tmp_path / "no_marker"))
    (no_marker / COMPLETE_MARKER).unlink()
    refused(caplog, "not a completed prepared dataset", overrides(tmp_path / "run2", no_marker))
    changed = Path(shutil.copytree(data, tmp_path / "changed"))
    manifest = json.loads((changed / MANIFEST_FILENAME).read_text())
    manifest["config"]["val_fraction"] = 0.5  # another argument than the one the data was made with
    (changed / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    refused(caplog, "does not match", overrides(tmp_path / "run3", changed))
    for run in ("run1", "run2", "run3"):
        assert not (tmp_path / run).exists(), "refused before creating anything"

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(1)
    (corpus / "a.txt").write_text(" ".join("".join(rng.choices("abcdefghij", k=5)) for _ in range(3000)))
    _prep(tmp_path / "out", [corpus])
    assert not leftover.exists(), "the rerun removed the dead run's work directory (its pid is gone)"
    assert unmarked.is_dir(), "a directory merely named like a work directory is not prep's to delete"
    shutil.rmtree(unmarked)
    before = read_manifest(tmp_path / "out")
    with pytest.raises(OutputExistsError):
        _prep(tmp_path / "out", [corpus], max_piece_tokens=128)
    assert read_manifest(tmp_path / "out") == before
    assert not list(tmp_path.glob(".out.*")), "no work directory left behind"

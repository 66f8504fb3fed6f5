"""The val split of a small corpus (data_prep/split.py): from two documents on, at least one is held out.

A new user's first corpus is small; with the default ``val_fraction`` (0.01) no document of 3 hashes into val, yet
``configs/train/debug.yaml`` evaluates. The document with the lowest hash goes to val instead, the tokenizer never
sees it, and the debug config trains and evaluates on the result. One document cannot be split: no val, and the
trainer refuses ``train.eval_every > 0`` as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import sentencepiece as spm
import xxhash

from data_prep import shard
from data_prep.config import load_config
from data_prep.format import read_manifest
from pipeline.train.trainer import main as train_main

REPO = Path(__file__).resolve().parents[2]
FILLER = "the river ran past old mills and quiet farms while a train crossed the valley at dawn".split()
MARKS = ["quokkaquokka", "zyzzyvazyzzyva", "axolotlaxolotl"]
"""One word of its own per document, repeated: a tokenizer trained on that document learns it as a piece."""


def _books(root: Path, n: int) -> list[Path]:
    root.mkdir()
    paths = []
    for i in range(n):
        words = [FILLER[(i * 5 + j) % len(FILLER)] for j in range(120)]
        text = " ".join(w if j % 6 else f"{w} {MARKS[i]}" for j, w in enumerate(words)) + "\n"
        paths.append(root / f"book{i}.txt")
        paths[-1].write_text(text)
    return paths


def _prep(out: Path, books: list[Path]):
    """Prep with every default that matters here (val_fraction 0.01, split_seed 0), a small trained tokenizer."""
    inputs = json.dumps([str(p) for p in books])
    return shard.main(
        load_config(None, [f"output={out}", f"input={inputs}", "tokenizer.vocab_size=320", "progress=false"])
    )


def _split_docs(split_dir: Path) -> dict[int, list[int]]:
    from streaming import StreamingDataset

    ds = StreamingDataset(local=str(split_dir), shuffle=False, batch_size=1)
    docs: dict[int, list[int]] = {}
    for i in range(len(ds)):
        docs.setdefault(int(ds[i]["doc_id"]), []).extend(ds[i]["tokens"].tolist())
    return docs


def _debug_run(run: Path, data: Path, vocab: int) -> list[str]:
    return [
        f"run_dir={run}",
        f"data.path={data}",
        f"model.vocab_size={vocab}",
        "train.max_steps=1",
        "schedule.warmup_steps=0",
        "train.eval_every=1",
        "checkpoint.export=false",
        "logging.progress=false",
    ]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_three_documents_with_the_default_val_fraction_hold_the_lowest_hash_out(tmp_path, caplog):
    books = _books(tmp_path / "corpus", 3)
    texts = [p.read_text() for p in books]
    hashes = [xxhash.xxh64_intdigest(t.encode(), seed=0) for t in texts]
    assert min(hashes) >= 0.01 * 2**64, "precondition: no document hashes into val_fraction=0.01 by itself"
    held_out = hashes.index(min(hashes))

    with caplog.at_level(logging.INFO):
        manifest = _prep(tmp_path / "data", books)
    assert (manifest.splits["val"].documents, manifest.splits["train"].documents) == (1, 2)
    assert (manifest.val_split.unit, manifest.val_split.lowest_hash_fallback) == ("documents", True)
    assert read_manifest(tmp_path / "data") == manifest
    assert "goes to val instead (documents, not tokens, are split)" in caplog.text
    assert f"{books[held_out].name}" in caplog.text
    assert "whole documents are split, not tokens" in caplog.text

    # The held-out document, whole, and nothing else; document ids are the input order.
    docs = _split_docs(tmp_path / "data" / "val")
    assert list(docs) == [held_out]
    tokenizer = spm.SentencePieceProcessor(model_file=str(tmp_path / "data" / "tokenizer.model"))
    assert tokenizer.decode(docs[held_out]) == texts[held_out]
    assert sorted(_split_docs(tmp_path / "data" / "train")) == sorted({0, 1, 2} - {held_out})

    # The tokenizer never saw the val document: its own word is no piece, those of the train documents are.
    pieces = {tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size())}
    assert [f"▁{mark}" in pieces for mark in MARKS] == [i != held_out for i in range(3)]

    # configs/train/debug.yaml (one step, evaluated) trains on it and evaluates on the held-out document.
    run = tmp_path / "run"
    code = train_main(
        str(REPO / "configs/train/debug.yaml"), _debug_run(run, tmp_path / "data", manifest.tokenizer.vocab_size)
    )
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [1]


def test_one_document_has_no_val_split_and_the_trainer_refuses_to_evaluate(tmp_path, caplog):
    manifest = _prep(tmp_path / "data", _books(tmp_path / "corpus", 1))
    assert (manifest.splits["val"].documents, manifest.splits["train"].documents) == (0, 1)
    assert not manifest.val_split.lowest_hash_fallback and not (tmp_path / "data" / "val").exists()
    with caplog.at_level(logging.ERROR):
        code = train_main(str(REPO / "configs/train/debug.yaml"), _debug_run(tmp_path / "run", tmp_path / "data", 320))
    assert code == 2
    assert "train.eval_every=1 but data.path=" in caplog.text and "validation split 'val'" in caplog.text

"""The val split of a small corpus (data_prep/split.py).

A new user's first corpus is small. Five books at the default ``val_fraction`` (0.01): one whole book would be ~20%
of the text, so ``val_unit=auto`` holds out the last 1% of every book instead, the tokenizer never sees it, and each
book's train ids followed by its val ids are the ids of the whole book. A corpus of many documents keeps whole
documents, exactly as the hash rule draws them. With ``val_unit=documents`` and no document of 3 hashing into val,
the one with the lowest hash goes there, and ``configs/train/debug.yaml`` trains and evaluates on the result; one
document then cannot be split (no val, and the trainer refuses ``train.eval_every > 0``), while ``auto`` holds out
its tail.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import sentencepiece as spm
import xxhash
from tqdm import tqdm

from data_prep import shard
from data_prep.config import load_config
from data_prep.errors import InputError
from data_prep.format import read_manifest
from data_prep.sources import resolve_sources
from data_prep.split import is_val, val_split
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


def _prep(out: Path, books: list[Path], *overrides: str):
    """Prep with every default that matters here (val_fraction 0.01, split_seed 0), a small trained tokenizer."""
    inputs = json.dumps([str(p) for p in books])
    settings = [f"output={out}", f"input={inputs}", "tokenizer.vocab_size=320", "progress=false", *overrides]
    return shard.main(load_config(None, settings))


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


def test_three_documents_by_documents_hold_the_lowest_hash_out(tmp_path, caplog):
    books = _books(tmp_path / "corpus", 3)
    texts = [p.read_text() for p in books]
    hashes = [xxhash.xxh64_intdigest(t.encode(), seed=0) for t in texts]
    assert min(hashes) >= 0.01 * 2**64, "precondition: no document hashes into val_fraction=0.01 by itself"
    held_out = hashes.index(min(hashes))

    with caplog.at_level(logging.INFO):
        manifest = _prep(tmp_path / "data", books, "val_unit=documents")
    assert (manifest.splits["val"].documents, manifest.splits["train"].documents) == (1, 2)
    assert (manifest.val_split.unit, manifest.val_split.lowest_hash_fallback) == ("documents", True)
    assert read_manifest(tmp_path / "data") == manifest
    assert "goes to val instead (whole documents are held out)" in caplog.text
    assert f"{books[held_out].name}" in caplog.text
    assert "val 1 docs / " in caplog.text and " tokens (whole documents)" in caplog.text

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


def test_one_document_by_documents_has_no_val_split_and_the_trainer_refuses_to_evaluate(tmp_path, caplog):
    manifest = _prep(tmp_path / "data", _books(tmp_path / "corpus", 1), "val_unit=documents")
    assert (manifest.splits["val"].documents, manifest.splits["train"].documents) == (0, 1)
    assert not manifest.val_split.lowest_hash_fallback and not (tmp_path / "data" / "val").exists()
    with caplog.at_level(logging.ERROR):
        code = train_main(str(REPO / "configs/train/debug.yaml"), _debug_run(tmp_path / "run", tmp_path / "data", 320))
    assert code == 2
    assert "train.eval_every=1 but data.path=" in caplog.text and "validation split 'val'" in caplog.text


def _tokenizer(data: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(data / "tokenizer.model"))


def test_one_document_by_default_holds_out_its_tail(tmp_path):
    book = _books(tmp_path / "corpus", 1)
    manifest = _prep(tmp_path / "data", book)
    assert manifest.val_split.unit == "tokens"
    train, val = _split_docs(tmp_path / "data" / "train"), _split_docs(tmp_path / "data" / "val")
    assert list(train) == list(val) == [0] and val[0]
    assert train[0] + val[0] == _tokenizer(tmp_path / "data").encode(book[0].read_text())


HEAD_ONLY, TAIL_ONLY = "ѯ", "ж"
"""A character only the first line of each book uses, and one only its last line: with ``character_coverage=1.0`` a
tokenizer has a piece for every character it was trained on, so it has one for the first and none for the second."""


def _five_books(root: Path) -> list[str]:
    """Five books of 20K to 60K characters of filler words, as the issue's five public-domain books at small scale."""
    root.mkdir()
    rng = random.Random(5)
    texts = []
    for i, size in enumerate((20_000, 60_000, 30_000, 45_000, 25_000)):
        lines = [f"{HEAD_ONLY} chapter one"]
        while sum(map(len, lines)) < size:
            lines.append(" ".join(rng.choice(FILLER) for _ in range(rng.randint(4, 14))))
        text = "\n".join(lines) + "\n"
        text += f"the end {TAIL_ONLY}\n"
        (root / f"book{i}.txt").write_text(text)
        texts.append(text)
    return texts


def test_five_books_hold_out_one_percent_of_their_tokens_as_the_tail_of_every_book(tmp_path, caplog):
    texts = _five_books(tmp_path / "books")
    with caplog.at_level(logging.INFO):
        manifest = _prep(tmp_path / "data", [tmp_path / "books"], "tokenizer.character_coverage=1.0")
    assert (manifest.val_split.unit, manifest.config["val_unit"]) == ("tokens", "auto")
    assert "holding out the last 1% of every document instead (val_unit=tokens" in caplog.text
    assert read_manifest(tmp_path / "data") == manifest

    val_tokens, total = manifest.splits["val"].tokens, manifest.splits["val"].tokens + manifest.splits["train"].tokens
    assert 0.005 <= val_tokens / total <= 0.02, (val_tokens, total)
    # Each book, tokenized on its own: its train ids are a head of those ids, its val ids the rest; no id of val is
    # at a position train holds, and none is left out.
    tokenizer = _tokenizer(tmp_path / "data")
    train, val = _split_docs(tmp_path / "data" / "train"), _split_docs(tmp_path / "data" / "val")
    assert sorted(train) == sorted(val) == list(range(5))
    for doc_id, text in enumerate(texts):
        whole = tokenizer.encode(text)
        assert val[doc_id] and train[doc_id] + val[doc_id] == whole, doc_id
        assert 0.005 <= len(val[doc_id]) / len(whole) <= 0.02
    assert (manifest.splits["train"].tokens, val_tokens) == (sum(map(len, train.values())), sum(map(len, val.values())))
    # The tokenizer was trained on the train parts only.
    assert tokenizer.piece_to_id(HEAD_ONLY) != tokenizer.unk_id()
    assert tokenizer.piece_to_id(TAIL_ONLY) == tokenizer.unk_id()


def _many_documents(root: Path, n: int) -> list[str]:
    root.mkdir()
    rng = random.Random(7)
    texts = [" ".join(rng.choice(FILLER) for _ in range(rng.randint(20, 60))) + f" {i}\n" for i in range(n)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def test_many_documents_keep_whole_documents_as_the_hash_rule_draws_them(tmp_path):
    texts = _many_documents(tmp_path / "corpus", 400)
    manifest = _prep(tmp_path / "data", [tmp_path / "corpus"], "val_fraction=0.05")
    assert (manifest.val_split.unit, manifest.val_split.lowest_hash_fallback) == ("documents", False)
    tokenizer = _tokenizer(tmp_path / "data")
    val = _split_docs(tmp_path / "data" / "val")
    assert sorted(val) == [i for i, t in enumerate(texts) if is_val(t, 0.05, 0)]
    assert sorted(_split_docs(tmp_path / "data" / "train")) == [i for i in range(400) if i not in val]
    assert all(val[i] == tokenizer.encode(texts[i]) for i in val), "whole documents"


def test_auto_decides_a_large_corpus_without_reading_all_of_it(tmp_path):
    """16 documents hashed into val that hold within 2x of val_fraction settle it (what a sliced run's every slice
    reads ahead); a corpus that does not settle is read to the end, as a malformed last record under strict shows."""
    _many_documents(tmp_path / "corpus", 2000)
    with (tmp_path / "corpus" / "docs.jsonl").open("a") as f:
        f.write("{not json\n")
    settings = [
        f"output={tmp_path / 'data'}",
        f"input={tmp_path / 'corpus'}",
        "tokenizer.vocab_size=320",
        "strict=true",
    ]
    cfg = load_config(None, [*settings, "val_fraction=0.05"])
    assert val_split(resolve_sources(cfg), cfg).unit == "documents"
    cfg = load_config(None, [*settings, "val_fraction=0.05", "val_unit=documents"])
    assert val_split(resolve_sources(cfg), cfg).unit == "documents"
    cfg = load_config(None, [*settings, "val_fraction=0.001"])  # ~2 documents of 2000 hash into val: not settled
    with pytest.raises(InputError, match="docs.jsonl:2001"):
        val_split(resolve_sources(cfg), cfg)


def test_the_tokenizer_sample_bar_counts_the_train_documents_it_samples_from(tmp_path, monkeypatch):
    counts: dict[str, int] = {}

    class Recorded(tqdm):
        def close(self) -> None:
            counts[str(self.desc)] = self.n
            super().close()

    monkeypatch.setattr(shard, "tqdm", Recorded)
    texts = _many_documents(tmp_path / "corpus", 60)
    manifest = _prep(tmp_path / "data", [tmp_path / "corpus"], "val_fraction=0.25", "progress=true")
    train = [t for t in texts if not is_val(t, 0.25, 0)]
    assert manifest.val_split.unit == "documents" and 0 < len(train) < len(texts)
    [(desc, count)] = [(d, n) for d, n in counts.items() if d.startswith("tokenizer sample")]
    assert count == len(train) == manifest.splits["train"].documents, desc

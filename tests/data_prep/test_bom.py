"""A UTF-8 byte-order mark at the start of an input is no text (issue 64, finding 14): a .jsonl whose first line
starts with one keeps that record (it was skipped as malformed JSON), and a .txt's tokens hold no U+FEFF; prep of
the files with the mark gives the same dataset as prep of the same files without it."""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm

from data_prep.format import Manifest

BOM = b"\xef\xbb\xbf"
TEXTS = [f"record {i} of the corpus, with words like river, mill and valley in it" for i in range(6)]
"""A sentence the 300-piece tokenizer does not learn at once: the mark, kept, would be a token of its own."""


def _corpus(root: Path, mark: bytes) -> Path:
    root.mkdir()
    records = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS[:4])
    (root / "records.jsonl").write_bytes(mark + records)
    (root / "notes.txt").write_bytes(mark + "\n".join(TEXTS[4:]).encode())
    return root


def _prep(run_prep, tmp_path: Path, name: str, mark: bytes) -> tuple[Manifest, Path]:
    out = tmp_path / f"out-{name}"
    manifest = run_prep(
        output=out, inputs=[str(_corpus(tmp_path / name, mark))], val_fraction=0.0, tokenizer__vocab_size=300
    )
    return manifest, out


def test_a_leading_byte_order_mark_is_stripped(run_prep, read_split, join_documents, tmp_path):
    with_mark, out = _prep(run_prep, tmp_path, "bom", BOM)
    plain, plain_out = _prep(run_prep, tmp_path, "plain", b"")
    assert with_mark.skipped == plain.skipped == {}, "the first .jsonl record is not malformed JSON"
    assert with_mark.splits["train"].documents == plain.splits["train"].documents == 5  # 4 records, 1 text file
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    docs = join_documents(read_split(out / "train"))
    texts = sorted(sp.decode(tokens) for tokens in docs.values())
    assert not any("\ufeff" in text for text in texts)
    assert texts == sorted([*TEXTS[:4], "\n".join(TEXTS[4:])])
    assert docs == join_documents(read_split(plain_out / "train")), "the same tokens as without the mark"

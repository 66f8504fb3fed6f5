"""``make bench-prep`` on a corpus written by the test: its raw encode and its prep runs count the same tokens (the
same texts), the tokens equal a plain per-document encode with the run's tokenizer, and its output leaves nothing
behind."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import sentencepiece as spm

from pipeline.bench import prep as bench_prep

REPO = Path(__file__).resolve().parents[2]


def test_bench_prep_times_the_same_tokens_as_a_plain_encode(tmp_path, monkeypatch):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 8))) for _ in range(300)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(50, 400))) for _ in range(30)]
    for i, text in enumerate(texts):
        (corpus / f"doc{i:02d}.txt").write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))  # the bench's scratch folder, to inspect and count
    models: list[bytes] = []
    real_processor = spm.SentencePieceProcessor

    def keep_model(*args, **kwargs):
        models.append(kwargs["model_proto"])
        return real_processor(*args, **kwargs)

    monkeypatch.setattr(bench_prep.spm, "SentencePieceProcessor", keep_model)

    r = bench_prep.bench(
        str(REPO / "configs/data/default.yaml"),
        [f"input={corpus}", "tokenizer.vocab_size=400", "val_fraction=0"],
        procs=[1, 2],
        repeats=2,
    )

    sp = real_processor(model_proto=models[0])
    expected = sum(len(sp.encode(text)) for text in texts)
    assert r["raw_tokens"] == r["prep_tokens"] == expected
    assert r["documents"] == len(texts)
    assert set(r["prep"]) == {1, 2}
    assert all(run["ratio"] > 0 and run["paired_ratio"] > 0 for run in r["prep"].values())
    assert list(work.glob("gca-bench-prep-*")) == []  # its scratch folder (outputs, tokenizer) removed

"""Bad input, long documents, big vocabularies, config and CLI errors."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from data_prep import tokenize
from data_prep.config import load_config
from data_prep.errors import ConfigError, InputError
from data_prep.format import SPLITS, read_manifest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def messy(tmp_path):
    """A corpus with one good document per file plus every kind of bad record."""
    root = tmp_path / "messy"
    root.mkdir()
    good = [
        "first good document with some words in it",
        "second good one\nover two lines",
        "third good document, from parquet",
    ]
    (root / "ok.txt").write_text(good[0])
    (root / "empty.txt").write_text("  \n\t\n")
    (root / "utf16.txt").write_bytes("a UTF-16 file".encode("utf-16"))
    (root / "recs.jsonl").write_bytes(
        b"\n".join(
            [
                json.dumps({"text": good[1]}).encode(),
                b'{"text": "unterminated',  # line 2: malformed JSON
                json.dumps({"body": "x"}).encode(),  # line 3: no text field
                json.dumps({"text": 123}).encode(),  # line 4: text is not a string
                b'{"text": "bad \xff byte"}',  # line 5: not UTF-8
                json.dumps({"text": ""}).encode(),  # line 6: empty
                b"",  # a blank line is not a record
                json.dumps(["not", "an", "object"]).encode(),  # line 8
            ]
        )
        + b"\n"
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [good[2], None]}), root / "rows.parquet")
    return root, good


def test_bad_records_are_skipped_counted_and_located(run_prep, messy, read_split, tmp_path, caplog, join_documents):
    root, good = messy
    manifest = run_prep(inputs=[str(root)], val_fraction=0.0, **{"tokenizer__vocab_size": 300})
    assert manifest.skipped == {"bad_field_type": 1, "empty": 2, "malformed_json": 2, "missing_field": 2, "non_utf8": 2}
    for where in (
        "recs.jsonl:2",
        "recs.jsonl:3",
        "recs.jsonl:4",
        "recs.jsonl:5",
        "recs.jsonl:8",
        "utf16.txt",
        "rows.parquet:row2",
    ):
        assert where in caplog.text
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    docs = join_documents(read_split(tmp_path / "out" / "train"))
    assert sorted(sp.decode(t) for t in docs.values()) == sorted(good)
    # an empty split is not written (StreamingDataset refuses an index without samples); the manifest says so
    assert (manifest.splits["val"].documents, manifest.splits["val"].tokens) == (0, 0)
    assert not manifest.has_split("val") and not (tmp_path / "out" / "val").exists()


def test_strict_fails_on_the_first_bad_record(run_prep, messy, tmp_path):
    root, _ = messy
    with pytest.raises(InputError, match=r"recs\.jsonl:2: malformed json.*strict=true"):
        run_prep(inputs=[str(root / "recs.jsonl")], strict=True)
    assert list(tmp_path.iterdir()) == [root]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: str(d / "missing.jsonl"), "does not exist"),
        (lambda d: (d / "empty_dir").mkdir() or str(d / "empty_dir"), "matched no"),
        (lambda d: str(d / "*.nothing"), "matched no"),
        (lambda d: (d / "x.csv").write_text("a,b") and str(d / "x.csv"), "unknown format"),
        (lambda d: (d / "p.parquet").write_text("not parquet") and str(d / "p.parquet"), "not a readable parquet"),
        (lambda d: "builtin:nope", "unknown built-in corpus"),
    ],
    ids=["missing", "empty-dir", "glob", "unknown-ext", "bad-parquet", "bad-builtin"],
)
def test_unusable_inputs_fail_with_a_named_error(run_prep, tmp_path, make, match):
    with pytest.raises(InputError, match=match):
        run_prep(output=tmp_path / "out", inputs=[make(tmp_path)])
    assert not (tmp_path / "out").exists()


def test_parquet_without_the_text_column(run_prep, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(InputError, match=r"t\.parquet: no column 'text' \(columns: body\)"):
        run_prep(inputs=[str(tmp_path / "t.parquet")])


def test_long_document_is_split_into_pieces_exactly(
    run_prep, corpus, read_split, tmp_path, monkeypatch, join_documents
):
    # Smaller encode segments, so a ~200 kB document crosses many of them (as a 50 MB one would the default).
    monkeypatch.setattr(tokenize, "SEGMENT_CHARS", 10_000)
    text = "".join(corpus[1])
    (tmp_path / "long.txt").write_text(text)
    assert len(tokenize.segments(text, tokenize.SEGMENT_CHARS)) > 10
    manifest = run_prep(
        inputs=[str(tmp_path / "long.txt"), str(corpus[0] / "a.jsonl")], max_piece_tokens=1000, val_fraction=0.0
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    samples = read_split(tmp_path / "out" / "train")
    assert max(len(s["tokens"]) for s in samples) == 1000
    docs = join_documents(samples)
    assert docs[0] == sp.encode(text), "segmenting the encode does not change the tokens"
    assert sp.decode(docs[0]) == text
    assert manifest.splits["train"].pieces == len(samples) == sum(-(-len(t) // 1000) for t in docs.values())


def test_segments_cover_text_without_spaces():
    text = "x" * 1000 + " tail"
    parts = tokenize.segments(text, max_chars=300)
    assert "".join(parts) == text and all(len(p) <= 300 for p in parts)


def _regex_segments(text: str, max_chars: int, cut_hard: bool) -> list[str]:
    """The reference: every safe point of each window's second half by the pattern, the last one taken."""
    safe = re.compile(r"(?<=\S) ")
    out, start = [], 0
    while len(text) - start > max_chars:
        window_end = start + max_chars
        points = [m.start() for m in safe.finditer(text, start + max_chars // 2, window_end)]
        cut = points[-1] if points else None
        if cut is None and not cut_hard:
            later = safe.search(text, window_end)
            if later is None:
                break
            cut = later.start()
        out.append(text[start : cut if cut is not None else window_end])
        start = cut if cut is not None else window_end
    return [*out, text[start:]]


@pytest.mark.parametrize("seed", range(6))
def test_segments_cut_where_the_safe_point_pattern_says(seed):
    """The rfind search picks the same cuts as scanning every match of the pattern, for texts with runs of
    spaces longer than its per-window tries (the pattern fallback), Unicode whitespace before spaces (\u00a0,
    \u2003, \x1c count as whitespace, \u200b does not) and stretches without any space."""
    rng = random.Random(seed)
    alphabet = ["a", "b", "é", "\n", "\t", "\u00a0", "\u2003", "\x1c", "\u200b", " "]
    pieces = []
    for _ in range(400):
        kind = rng.random()
        if kind < 0.05:
            pieces.append(" " * rng.randint(60, 300))
        elif kind < 0.08:
            pieces.append("z" * rng.randint(200, 700))
        else:
            pieces.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))))
    text = "".join(pieces)
    for max_chars in (2, 7, 64, 257, 1000):
        for cut_hard in (True, False):
            parts = tokenize.segments(text, max_chars, cut_hard)
            assert parts == _regex_segments(text, max_chars, cut_hard), (max_chars, cut_hard)
            assert "".join(parts) == text


def test_segmenting_a_50mb_document_is_fast():
    import time

    text = ("word " * 10_000_000)[:-1]
    # CPU time, not wall clock: a quadratic segmenter needs minutes of it, while a loaded machine (other jobs on
    # the same cores) only stretches the wall clock -- which once failed this test with nothing wrong.
    start = time.process_time()
    parts = tokenize.segments(text)
    assert time.process_time() - start < 5.0
    assert sum(map(len, parts)) == len(text) and max(map(len, parts)) <= tokenize.SEGMENT_CHARS


def test_big_vocab_uses_uint32(run_prep, corpus, read_split, tmp_path, join_documents):
    run_prep(output=tmp_path / "small")
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "small" / "tokenizer.model").read_bytes())
    for i in range(70_000 - len(proto.pieces)):  # UNUSED pieces never match text, they only widen the ids
        proto.pieces.add(piece=f"<unused{i}>", score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.UNUSED)
    big = tmp_path / "big.model"
    big.write_bytes(proto.SerializeToString())
    manifest = run_prep(output=tmp_path / "out", **{"tokenizer__model": big})
    assert manifest.token_dtype == "uint32" and manifest.tokenizer.vocab_size == 70_000
    assert not manifest.tokenizer.trained
    sp = spm.SentencePieceProcessor(model_file=str(big))
    texts = set()
    for split in SPLITS:
        samples = read_split(tmp_path / "out" / split)
        assert all(s["tokens"].dtype == np.uint32 for s in samples)
        texts |= {sp.decode(t) for t in join_documents(samples).values()}
    assert texts == set(corpus[1])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["tokenizer.vocab_sise=4"], r"unknown config key 'tokenizer.vocab_sise'; did you mean 'tokenizer.vocab_size'"),
        (["val_fractoin=0.1"], r"unknown config key 'val_fractoin'; did you mean 'val_fraction'"),
        (["num_proc=two"], r"'num_proc'.*two"),
        (["encode_threads=-1"], r"encode_threads=-1.*0 \(auto\)"),
        (["val_fraction=1.5"], r"val_fraction=1.5"),
        (["format=csv"], r"'format'.*csv"),
        (["tokenizer.model=/no/such.model"], r"set exactly one"),
        (["tokenizer.vocab_size=null", "tokenizer.model=/no/such.model"], r"tokenizer.model='/no/such.model'"),
        (["tokenizer.vocab_size=100"], r"tokenizer.vocab_size=100"),
        (["shard_size_bytes=8589934592"], r"shard_size_bytes=8589934592"),
        (["novalue"], r"'novalue' is not of the form key=value"),
    ],
)
def test_config_errors_name_the_key(overrides, match):
    base = ["output=x", "input=y", "tokenizer.vocab_size=400"]
    with pytest.raises(ConfigError, match=match):
        load_config(None, base + overrides)


def test_missing_output_is_reported():
    with pytest.raises(ConfigError, match="config key 'output' is required"):
        load_config(None, ["input=y", "tokenizer.vocab_size=400"])


def test_shipped_configs_load():
    for path in sorted((REPO / "configs" / "data").glob("*.yaml")):
        cfg = load_config(path, [])
        assert cfg.output.startswith("data/") and cfg.tokenizer.vocab_size


def test_cli_reports_one_line_errors(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "launch" / "prep.py"),
        "--config",
        str(REPO / "configs/data/default.yaml"),
        "tokenizer.vocab_sise=8",
        f"output={tmp_path / 'o'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "prep: error: unknown config key 'tokenizer.vocab_sise'; did you mean 'tokenizer.vocab_size'? "
        "(in override 'tokenizer.vocab_sise=...'; "
        "known keys under 'tokenizer': character_coverage, model, model_type, path, sample_bytes, type, vocab_size)"
    ]


@pytest.mark.slow
def test_builtin_default_corpus(tmp_path, read_split):
    cfg = load_config(REPO / "configs/data/default.yaml", [f"output={tmp_path / 'default'}", "progress=false"])
    from data_prep.shard import main

    manifest = main(cfg)
    assert read_manifest(tmp_path / "default") == manifest
    # 10.05M tokens with Python 3.11.7; other patch releases ship slightly different stdlib sources
    assert sum(s.tokens for s in manifest.splits.values()) >= 9_500_000
    assert len(read_split(tmp_path / "default" / "val")) == manifest.splits["val"].pieces


def test_not_a_sentencepiece_model(run_prep, tmp_path):
    (tmp_path / "bad.model").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"tokenizer.model=.*bad.model.*not a SentencePiece model"):
        run_prep(**{"tokenizer__model": tmp_path / "bad.model"})


def test_excluded_files_never_reach_the_dataset(run_prep, corpus, read_split, tmp_path, join_documents):
    """`exclude` holds files out: the dataset holds exactly the documents of the other files (train + val)."""
    root, _ = corpus
    kept_books = [p for p in sorted((root / "books").glob("*.txt")) if p.name not in ("book00.txt", "book07.txt")]
    run_prep(inputs=[str(root / "books")], exclude='["book00.txt", "book0[7].txt"]', val_fraction=0.0)
    docs = join_documents(read_split(tmp_path / "out" / "train"))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    got = sorted(sp.decode(tokens) for tokens in docs.values())
    assert got == sorted(p.read_text(encoding="utf-8") for p in kept_books)


def test_exclude_matches_relative_paths_across_directories(run_prep, corpus, read_split, tmp_path):
    """``*`` crosses ``/``: one pattern leaves out a whole sub-directory of a directory input."""
    root, _ = corpus
    manifest = run_prep(inputs=[str(root)], exclude="books/*", val_fraction=0.0)
    assert manifest.splits["train"].documents == 40 + 40 + 30 + 40  # every record but the 12 books


def test_exclude_pattern_matching_nothing_is_an_error(run_prep, corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(InputError, match=r"exclude=.*\['emial/\*'\] matched no input file"):
        run_prep(inputs=[str(root / "books")], exclude='["book00.txt", "emial/*"]')
    assert not (tmp_path / "out").exists()


def test_excluding_every_file_of_an_input_is_an_error(run_prep, corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(InputError, match=r"every file is excluded by exclude=\['\*'\]"):
        run_prep(inputs=[str(root / "books")], exclude='"*"')


def test_builtin_corpus_lists_its_files_by_relative_path(tmp_path, monkeypatch):
    """The built-in corpus: .py/.txt files under the stdlib root, sorted by their POSIX path relative to it (the
    label), without third-party or cache folders and without following a linked folder out of the tree."""
    from data_prep import builtin

    root = tmp_path / "stdlib"
    for name in ["b.py", "b/c.txt", "b/z/e.py", "a/f.py", "b/d.bin", "site-packages/x.py", "b/__pycache__/y.py"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    (root / "outside").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "g.py").write_text("x")
    monkeypatch.setattr(builtin.sysconfig, "get_paths", lambda: {"stdlib": str(root)})

    got_root, labelled = builtin.labelled_corpus_files("python_stdlib")
    assert got_root == root
    # '.' sorts before '/': b.py comes before the files of folder b
    assert [label for label, _ in labelled] == ["a/f.py", "b.py", "b/c.txt", "b/z/e.py"]
    assert all(path.relative_to(root).as_posix() == label for label, path in labelled)
    assert builtin.corpus_files("python_stdlib") == (root, [path for _, path in labelled])

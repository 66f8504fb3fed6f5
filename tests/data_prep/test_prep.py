"""make prep end to end on a small generated corpus: round trip, counts, determinism, safety."""

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data_prep import shard, tokenize
from data_prep.errors import OutputExistsError
from data_prep.format import COMPLETE_MARKER, SPLITS, IncompleteDatasetError, read_manifest
from data_prep.sources import FileSource
from data_prep.split import is_val

REPO = Path(__file__).resolve().parents[2]


def _shard_bytes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json" and p.name != COMPLETE_MARKER
    }


def test_round_trip_and_counts(run_prep, corpus, read_split, tmp_path, join_documents):
    manifest = run_prep()
    out = tmp_path / "out"
    assert read_manifest(out) == manifest
    model = (out / "tokenizer.model").read_bytes()
    assert hashlib.sha256(model).hexdigest() == manifest.tokenizer.sha256
    assert manifest.token_dtype == "uint16" and manifest.tokenizer.trained
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))  # independent of data_prep
    decoded: dict[str, set[str]] = {}
    for split in SPLITS:
        samples = read_split(out / split)
        assert all(s["tokens"].dtype == np.uint16 for s in samples)
        docs = join_documents(samples)
        stats = manifest.splits[split]
        assert (stats.documents, stats.pieces, stats.tokens) == (
            len(docs),
            len(samples),
            sum(len(t) for t in docs.values()),
        )
        decoded[split] = {sp.decode(tokens) for tokens in docs.values()}
        assert all(sp.encode(text) == docs[i] for i, text in zip(docs, map(sp.decode, docs.values())))
    texts = set(corpus[1])
    assert decoded["train"] | decoded["val"] == texts, "every document comes back exactly, whitespace included"
    assert not decoded["train"] & decoded["val"]
    assert 0 < manifest.splits["val"].documents < manifest.splits["train"].documents
    assert manifest.skipped == {}
    assert len(manifest.inputs) == 12 + 4 and all(i.size and i.mtime_ns for i in manifest.inputs)


def test_deterministic_across_runs_and_process_counts(run_prep, tmp_path):
    """The same bytes whatever the processes and SentencePiece's batch-encode threads (the automatic split of the
    CPUs, one thread, and more threads than texts per call); test_round_trip_and_counts checks the ids against a
    plain per-document encode."""
    a = run_prep(output=tmp_path / "a", num_proc=1)
    b = run_prep(output=tmp_path / "b", num_proc=2)
    c = run_prep(output=tmp_path / "c", num_proc=1, encode_threads=1)
    d = run_prep(output=tmp_path / "d", num_proc=2, encode_threads=8)
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "b")
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "c") == _shard_bytes(tmp_path / "d")
    assert (a.splits, a.tokenizer, a.skipped, a.inputs) == (b.splits, b.tokenizer, b.skipped, b.inputs)
    assert (a.splits, a.tokenizer) == (c.splits, c.tokenizer) == (d.splits, d.tokenizer)
    assert len(list((tmp_path / "a" / "train").glob("shard.*.mds.zstd"))) > 1


def test_encode_threads_share_the_cpus_among_the_processes():
    cpus = len(os.sched_getaffinity(0))
    assert tokenize.encode_threads(1) == cpus
    assert tokenize.encode_threads(cpus) == 1 and tokenize.encode_threads(cpus * 8) == 1
    assert tokenize.encode_threads(cpus * 8, requested=3) == 3


def test_split_is_per_document_content(corpus):
    texts = corpus[1]
    first = [is_val(t, 0.2, 0) for t in texts]
    assert first == [is_val(t, 0.2, 0) for t in reversed(texts)][::-1]
    assert first != [is_val(t, 0.2, 1) for t in texts], "split_seed draws a different split"
    assert 0.1 < sum(first) / len(first) < 0.3


def test_refuses_to_overwrite(run_prep, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("not ours")
    with pytest.raises(OutputExistsError, match="overwrite=true"):
        run_prep()
    assert (out / "precious.txt").read_text() == "not ours"
    with pytest.raises(OutputExistsError, match="not a complete dataset written by prep"):
        run_prep(overwrite=True)  # overwrite replaces only a dataset prep wrote
    assert (out / "precious.txt").read_text() == "not ours"
    (out / "precious.txt").unlink()
    out.rmdir()
    first = run_prep()
    manifest = run_prep(overwrite=True, val_fraction=0.5)
    assert read_manifest(out) == manifest != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporaries left next to the output"


class _Crash(Exception):
    pass


def _crash_after(monkeypatch, n):
    real = shard._SplitWriter.write
    calls = iter(range(n + 1))

    def write(self, doc_id, tokens):
        if next(calls, n) >= n:
            raise _Crash("simulated crash mid-write")
        real(self, doc_id, tokens)

    monkeypatch.setattr(shard._SplitWriter, "write", write)


def test_crash_mid_write_leaves_nothing(run_prep, tmp_path, monkeypatch):
    _crash_after(monkeypatch, 20)
    with pytest.raises(_Crash):
        run_prep()
    assert list(tmp_path.iterdir()) == [], "no output and no temporary directory"
    with pytest.raises(IncompleteDatasetError):
        read_manifest(tmp_path / "out")


def test_crash_during_overwrite_keeps_old_dataset(run_prep, tmp_path, monkeypatch):
    old = run_prep()
    _crash_after(monkeypatch, 5)
    with pytest.raises(_Crash):
        run_prep(overwrite=True, val_fraction=0.5)
    assert read_manifest(tmp_path / "out") == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_killed_process_leaves_no_complete_output_and_rerun_cleans_up(corpus, tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent("""
        import os, sys
        from data_prep import shard
        from data_prep.config import load_config
        real, n = shard._SplitWriter.write, [0]
        def write(self, doc_id, tokens):
            n[0] += 1
            if n[0] == 30:
                os._exit(9)  # like SIGKILL: no exception handlers, no cleanup
            real(self, doc_id, tokens)
        shard._SplitWriter.write = write
        shard.main(load_config(None, sys.argv[1:]))
    """)
    args = [f"output={out}", f"input={corpus[0]}", "tokenizer.vocab_size=400", "progress=false"]
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, timeout=120, capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    leftovers = list(tmp_path.iterdir())
    assert [p.name.startswith(".out.tmp-") for p in leftovers] == [True]
    assert not (leftovers[0] / COMPLETE_MARKER).exists() and not out.exists()
    with pytest.raises(IncompleteDatasetError):
        read_manifest(leftovers[0])
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "prep.py"), *args], cwd=REPO, timeout=120, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the stale temporary was removed"
    read_manifest(out)


def test_tampered_manifest_is_rejected(run_prep, tmp_path):
    run_prep()
    path = tmp_path / "out" / "manifest.json"
    obj = json.loads(path.read_text())
    obj["splits"]["train"]["tokens"] += 1
    path.write_text(json.dumps(obj))
    with pytest.raises(IncompleteDatasetError, match="does not match"):
        read_manifest(tmp_path / "out")
    os.remove(tmp_path / "out" / COMPLETE_MARKER)
    with pytest.raises(IncompleteDatasetError, match="not a completed"):
        read_manifest(tmp_path / "out")


def test_each_encode_thread_reuses_its_own_sentencepiece_pool():
    """encode_segments: the ids of a plain per-text encode; a thread's calls share one one-thread SentencePiece pool
    (no native thread started per call), another thread has its own."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=60, model_type="bpe")
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    texts = lines[:5]
    pools: dict[str, list[object]] = {}

    def encode_twice(name: str) -> None:
        for _ in range(2):
            got = tokenize.encode_segments(sp, texts)
            assert [ids.tolist() for ids in got] == [sp.encode(t) for t in texts]
            assert all(ids.dtype == np.uint32 for ids in got)
            pools.setdefault(name, []).append(tokenize._encode_pools.pool)

    threads = [threading.Thread(target=encode_twice, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pools["a"]) == len(pools["b"]) == 2  # both threads ran their asserts to the end
    assert pools["a"][0] is pools["a"][1] and pools["b"][0] is pools["b"][1]
    assert pools["a"][0] is not pools["b"][0]


def test_a_failed_finish_does_not_wait_for_the_remaining_fingerprints(run_prep, corpus, tmp_path, monkeypatch):
    """Finishing the splits and fingerprinting the inputs run side by side; when finishing fails (a full disk), its
    error is raised once the input being hashed is done, not after hashing every input (``fingerprint=content`` of a
    large corpus), and nothing is left behind."""
    hashed: list[str] = []
    real_fingerprint = FileSource.fingerprint
    first_started = threading.Event()

    def slow_fingerprint(self, content):
        first_started.set()
        time.sleep(0.2)
        hashed.append(self.name)
        return real_fingerprint(self, content)

    def full_disk(self):
        first_started.wait(timeout=30)  # fail while the first input is being hashed
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSource, "fingerprint", slow_fingerprint)
    monkeypatch.setattr(shard._SplitWriter, "finish", full_disk)
    files = sorted(str(p) for p in (corpus[0] / "books").glob("*.txt"))
    assert len(files) >= 10
    with pytest.raises(shard.OutputWriteError, match="the disk is full"):
        run_prep(inputs=files, fingerprint="content")
    assert 1 <= len(hashed) < len(files)
    assert list(tmp_path.iterdir()) == []

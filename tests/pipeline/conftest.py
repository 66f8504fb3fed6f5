"""Fixtures for the pipeline tests: a tiny learnable MDS dataset (as data prep writes it) and tiny-run overrides."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from helpers import MARKOV_VOCAB, markov_pieces, train_overrides, train_test_tokenizer, write_mds_split

from data_prep import format as fmt
from pipeline.train.preflight import open_files

VOCAB = MARKOV_VOCAB
EOS = 1


def write_mds(root: Path, split: str, n_docs: int, seed: int, size_limit: int = 4096) -> None:
    """``n_docs`` documents of the tests' learnable Markov chain (``helpers.markov_pieces``) as an MDS split."""
    write_mds_split(root / split, markov_pieces(n_docs, seed, VOCAB), size_limit=size_limit, hashes=("xxh64",))


def _tokenizer_bytes() -> bytes:
    from pipeline.data.needle import NEEDLE, QUESTION

    words = "the grass is green the sky is blue here we go again".split()
    rng = np.random.default_rng(0)
    lines = [
        " ".join(rng.choice(words, 12)) + NEEDLE.format(key=rng.integers(10000, 99999)) + QUESTION for _ in range(400)
    ]
    return train_test_tokenizer(lines, VOCAB, byte_fallback=False, eos_id=EOS)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch):
    """One intra-op thread: the CI machines have 2 shared cores, and tiny ops slow down 20x when oversubscribed."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset: train (200 docs, ~12 shards), val (20 docs) and a 64-piece tokenizer. No manifest,
    so the trainer packs documents without an EOS separator (and says so)."""
    root = tmp_path_factory.mktemp("tiny_data")
    write_mds(root, "train", 200, seed=1)
    write_mds(root, "val", 20, seed=2)
    (root / fmt.TOKENIZER_FILENAME).write_bytes(_tokenizer_bytes())
    return root


def split_stats(root: Path, split: str) -> fmt.SplitStats:
    """The counts data prep records for ``root/split``, read back from its samples, and its index's hash."""
    from pipeline.data.reader import MDSReader

    reader = MDSReader(str(root), split, cache_dir=None)
    shards = range(reader.num_shards)
    samples = [reader.sample(s, i) for s in shards for i in range(int(reader.samples_per_shard[s]))]
    return fmt.SplitStats(
        documents=len({doc for _, doc in samples}),
        pieces=len(samples),
        tokens=sum(len(tokens) for tokens, _ in samples),
        index_sha256=hashlib.sha256((root / split / "index.json").read_bytes()).hexdigest(),
    )


def length_histogram(root: Path, split: str) -> fmt.LengthHistogram:
    """The length histogram data prep records of ``root/split``, counted from its samples (a document is all its
    pieces, whichever shards hold them)."""
    from pipeline.data.reader import MDSReader

    reader = MDSReader(str(root), split, cache_dir=None)
    lengths: dict[int, int] = {}
    shards: dict[int, set[int]] = {}
    for shard in range(reader.num_shards):
        for index in range(int(reader.samples_per_shard[shard])):
            tokens, doc = reader.sample(shard, index)
            lengths[doc] = lengths.get(doc, 0) + len(tokens)
            shards.setdefault(doc, set()).add(shard)
    bins = max(fmt.length_bin(n) for n in lengths.values()) + 1
    documents, tokens = [0] * bins, [0] * bins
    for n in lengths.values():
        documents[fmt.length_bin(n)] += 1
        tokens[fmt.length_bin(n)] += n
    spanning = {str(doc): lengths[doc] for doc, where in shards.items() if len(where) > 1}
    return fmt.LengthHistogram(documents=documents, tokens=tokens, spanning_documents=spanning)


def seal_prepared(root: Path, vocab: int = 64, histograms: bool = False) -> Path:
    """Write the manifest and completion marker data prep writes for the splits and tokenizer in ``root`` (a split
    that is not there is recorded empty; ``histograms``: each split's length histogram too)."""
    empty = fmt.SplitStats(documents=0, pieces=0, tokens=0, index_sha256=fmt.EMPTY_SPLIT_SHA256)

    def stats(split: str) -> fmt.SplitStats:
        if not (root / split).is_dir():
            return empty
        histogram = length_histogram(root, split) if histograms else None
        return dataclasses.replace(split_stats(root, split), length_histogram=histogram)

    manifest = fmt.Manifest(
        format_version=fmt.FORMAT_VERSION,
        token_dtype="uint16",
        tokenizer=fmt.TokenizerInfo(
            sha256=hashlib.sha256((root / fmt.TOKENIZER_FILENAME).read_bytes()).hexdigest(),
            vocab_size=vocab,
            model_type="bpe",
            trained=True,
            unk_id=0,
            bos_id=-1,
            eos_id=1,
            pad_id=-1,
        ),
        splits={s: stats(s) for s in fmt.SPLITS},
        skipped={},
        inputs=[],
        config={},
    )
    data = manifest.to_json().encode()
    (root / fmt.MANIFEST_FILENAME).write_bytes(data)
    (root / fmt.COMPLETE_MARKER).write_text(hashlib.sha256(data).hexdigest() + "\n")
    return root


def prepared_copy(tmp_path: Path, tiny_data: Path, vocab: int = 64) -> Path:
    """A copy of ``tiny_data`` with the manifest and completion marker data prep writes."""
    root = tmp_path / "data"
    shutil.copytree(tiny_data, root)
    return seal_prepared(root, vocab)


def prepared_dataset(
    root: Path, tokenizer: bytes, train: Iterable, val: Iterable | None, histograms: bool = False
) -> Path:
    """A prepared dataset at ``root`` from ``(doc_id, piece, tokens)`` rows (`write_mds_split`, 4 KB shards):
    its splits (no ``val``: recorded empty), the tokenizer, the manifest and its marker (`seal_prepared`)."""
    write_mds_split(root / "train", train, size_limit=4096, hashes=("xxh64",))
    if val is not None:
        write_mds_split(root / "val", val, size_limit=4096, hashes=("xxh64",))
    (root / fmt.TOKENIZER_FILENAME).write_bytes(tokenizer)
    return seal_prepared(root, VOCAB, histograms)


def tiny_overrides(run_dir: Path, data: Path, **extra: object) -> list[str]:
    """Overrides for a ~0.05M-parameter model on ``tiny_data`` (CPU, naive backend, a few ms per step)."""
    return train_overrides(run_dir, data, extra)


@pytest.fixture(scope="session")
def overrides():
    return tiny_overrides


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Per-step metrics of a run; a step logged twice (re-run after a crash) keeps its last record."""
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and "loss" in rec:
            records[rec["step"]] = rec
    return records


@pytest.fixture
def metrics():
    return read_metrics


@pytest.fixture
def clean_shm():
    """Remove the DeepSpeed CPU allreduce buffers a test's run left in /dev/shm (a rank killed at start-up, before it
    unlinks its own: `pipeline.train.deepspeed_cpu`). A new file that a live process maps is another job's: kept."""
    before = set(glob.glob("/dev/shm/*"))
    yield
    in_use = open_files()
    for path in set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) - before - in_use:
        try:
            os.remove(path)
        except OSError:
            pass

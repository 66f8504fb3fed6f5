"""T8 (loader order across resume), T9 (elastic partition), T10 (shard integrity, dataset fingerprint),
T11 (path traversal and unsafe column encodings in a dataset index). One process, no model for T8/T9."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import train_test_tokenizer
from reliability_harness import committed, flip_byte, overrides

from data_prep.streaming_compat import ensure_streaming_importable
from pipeline.data.reader import (
    MDSReader,
    PackedSequences,
    RankBatches,
    UnsafeColumnError,
    UnsafeShardPathError,
)
from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability


class FakeReader:
    """``MDSReader``'s interface over synthetic samples: token values are unique global token indices, so any
    duplicated or missing token in an epoch is visible."""

    def __init__(self, lengths: list[list[int]]) -> None:
        self.samples_per_shard = np.array([len(s) for s in lengths], dtype=np.int64)
        self.num_shards = len(lengths)
        self._tokens, start = [], 0
        for shard in lengths:
            row = []
            for n in shard:
                row.append(np.arange(start, start + n))
                start += n
            self._tokens.append(row)
        self.total = start

    def sample(self, shard: int, index: int) -> tuple[np.ndarray, int]:
        return self._tokens[shard][index], shard * 1000 + index


def _steps(batches: RankBatches, n: int) -> list[np.ndarray]:
    return [np.concatenate([m.numpy() for m in batches.next_step()]) for _ in range(n)]


# -- T8 ------------------------------------------------------------------------------------------------------------


def test_t08_resume_at_every_step_including_the_exact_epoch_end():
    """5 shards of uneven samples (320 tokens = 40 sequences of 8 = exactly 20 steps of 2): resuming after any of
    the 60 steps (3 epochs; mid-window, window ends, the epoch ends at 20 and 40) continues the identical stream;
    every epoch holds every token exactly once; epochs are shuffled differently."""
    lengths = [[16, 16, 16, 16], [10, 22, 16, 16], [16, 16, 16, 16], [30, 2, 16, 16], [16, 16, 16, 16]]
    reader = FakeReader(lengths)

    def fresh() -> RankBatches:
        return RankBatches(
            PackedSequences(reader, seq_len=8, seed=3, shuffle=True, window=4, eos_id=None),
            global_batch=2,
            micro_batch=1,
            rank=0,
            world_size=1,
        )

    straight = _steps(fresh(), 60)
    epochs = [np.sort(np.concatenate(straight[e * 20 : (e + 1) * 20]).ravel()) for e in range(3)]
    for tokens in epochs:
        assert np.array_equal(tokens, np.arange(reader.total)), "every token exactly once per epoch"
    firsts = [straight[e * 20][0][0] for e in range(3)]
    assert len(set(firsts)) > 1, "epochs start differently (the shard order is reshuffled per epoch)"
    for k in range(61):
        head = fresh()
        _steps(head, k)
        state = json.loads(json.dumps(head.state_dict()))  # as stored in trainer_state.json
        tail = fresh()
        tail.load_state_dict(state)
        resumed = _steps(tail, 60 - k)
        assert all(np.array_equal(a, b) for a, b in zip(straight[k:], resumed)), f"resume after step {k} diverges"


def test_t08_real_dataset_resume_mid_epoch_and_across_the_epoch_boundary(data):
    """The real MDS reader, unshuffled and shuffled: resume points inside the first epoch and right after the
    boundary give the same stream as reading straight through."""
    reader = MDSReader(str(data), "train", None)
    total = sum(
        int(reader.sample(s, i)[0].size) + 1
        for s in range(reader.num_shards)
        for i in range(int(reader.samples_per_shard[s]))
    )  # +1 upper bound for EOS separators
    steps = total // (4 * 64) + 3  # crosses into epoch 2
    for shuffle in (False, True):

        def fresh(shuffle: bool = shuffle) -> RankBatches:
            return RankBatches(
                PackedSequences(reader, seq_len=64, seed=7, shuffle=shuffle, window=8, eos_id=1),
                global_batch=4,
                micro_batch=2,
                rank=0,
                world_size=1,
            )

        straight = _steps(fresh(), steps)
        for k in (1, 5, steps // 2, steps - 3, steps - 2):
            head = fresh()
            _steps(head, k)
            tail = fresh()
            tail.load_state_dict(head.state_dict())
            assert all(np.array_equal(a, b) for a, b in zip(straight[k:], _steps(tail, steps - k))), (shuffle, k)


# -- T9 ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("resume_at", [0, 37, 500])
def test_t09_elastic_partition(resume_at):
    """1000 samples, global batch 12: world sizes 1, 2, 3, 4, 6 see identical global batches (each rank a
    contiguous slice), every sample once per epoch, and a state saved at any world size resumes on any other."""
    reader = FakeReader([[5] * 100 for _ in range(10)])  # 1000 samples of 5 tokens = 1000 sequences of 5

    def ranks(world: int) -> list[RankBatches]:
        return [
            RankBatches(
                PackedSequences(reader, seq_len=5, seed=11, shuffle=True, window=10, eos_id=None),
                global_batch=12,
                micro_batch=1,
                rank=r,
                world_size=world,
            )
            for r in range(world)
        ]

    def global_batches(parts: list[RankBatches], n: int) -> list[np.ndarray]:
        return [np.concatenate([_steps(p, 1)[0] for p in parts]) for _ in range(n)]

    reference = global_batches(ranks(1), resume_at + 100)
    first_epoch = np.concatenate(reference)[:1000, 0] // 5  # sequence -> sample id
    if resume_at == 0:
        assert np.array_equal(np.sort(first_epoch), np.arange(1000)), "every sample exactly once per epoch"
    for world in (2, 3, 4, 6):
        assert all(np.array_equal(a, b) for a, b in zip(reference[:20], global_batches(ranks(world), 20))), world
        head = ranks(world)
        for p in head:
            _steps(p, resume_at)
        state = head[0].state_dict()
        assert all(p.state_dict() == state for p in head), "the loader state is global, the same on every rank"
        for new_world in (1, 4, 6):
            tail = ranks(new_world)
            for p in tail:
                p.load_state_dict(state)
            resumed = global_batches(tail, 100)
            assert all(np.array_equal(a, b) for a, b in zip(reference[resume_at:], resumed)), (world, new_world)


# -- T10 -----------------------------------------------------------------------------------------------------------


def _first_shard(data_dir: Path) -> int:
    reader = MDSReader(str(data_dir), "train", None)
    return int(PackedSequences(reader, seq_len=64, seed=7, shuffle=True, window=8, eos_id=1)._shard_order(0)[0])


def test_t10_corrupt_compressed_shard_is_caught_before_use(data_copy):
    shard = _first_shard(data_copy)
    for raw in (data_copy / "train").glob("shard.*.mds"):
        raw.unlink()  # only the compressed shards, as data prep writes them
    zipped = data_copy / "train" / f"shard.{shard:05d}.mds.zstd"
    flip_byte(zipped)
    reader = MDSReader(str(data_copy), "train", None)
    assert reader.hash_algo == "xxh64", "validation is on by default, with the fastest recorded hash"
    with pytest.raises(ValueError, match=rf"Checksum failure: .*shard\.{shard:05d}\.mds\.zstd"):
        reader.sample(shard, 0)


def test_t10_corrupt_extracted_shard_is_caught_by_the_trainer(data_copy, tmp_path, caplog):
    """A shard extracted next to its ``.zstd`` (as streaming did when it read a dataset in place) and damaged
    since: the raw file is preferred, and its hash is checked."""
    from streaming.base.compression import decompress

    shard = _first_shard(data_copy)
    raw = data_copy / "train" / f"shard.{shard:05d}.mds"
    raw.write_bytes(decompress("zstd", raw.with_name(raw.name + ".zstd").read_bytes()))
    flip_byte(raw)
    with caplog.at_level(logging.ERROR):
        assert main(None, overrides(tmp_path / "run", data_copy)) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and re.search(
        rf"data error at step 1 .*Checksum failure: .*shard\.{shard:05d}\.mds: "
        "xxh64",
        errors[0],
    ), errors
    assert not (tmp_path / "run" / "checkpoints").exists()


def _other_tokenizer() -> bytes:
    """A SentencePiece model as valid as the dataset's (same size and EOS id) but trained on other text."""
    return train_test_tokenizer([f"other words for model {i} and more text {i * 7}" for i in range(300)], 64)


@pytest.mark.parametrize("change", ["tokenizer", "more_documents"])
def test_t10_dataset_fingerprint_mismatch_on_resume(change, data_copy, tmp_path, caplog):
    import dataclasses
    import hashlib

    from reliability_harness import rewrite_split, write_manifest

    from data_prep import format as fmt

    run = tmp_path / "run"
    assert main(None, overrides(run, data_copy, **{"train.max_steps": 4})) == 0
    state = json.loads((run / "checkpoints/step_00000004/trainer_state.json").read_text())
    old = state["data_fingerprint"]
    if change == "tokenizer":
        (data_copy / "tokenizer.model").write_bytes(other := _other_tokenizer())  # a valid model, other pieces
        # Resealed (manifest and _COMPLETE name the new model), else the start check refuses it before the resume.
        manifest = fmt.read_manifest(data_copy)
        tokenizer = dataclasses.replace(manifest.tokenizer, sha256=hashlib.sha256(other).hexdigest())
        write_manifest(data_copy, dataclasses.replace(manifest, tokenizer=tokenizer))
        key = "tokenizer_sha256"
    else:
        rewrite_split(data_copy, "train", 210, seed=1)  # prepared again with more documents, manifest included
        key = "index_sha256"
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert main(None, overrides(run, data_copy, **{"train.max_steps": 8})) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and re.search(
        rf"dataset fingerprint mismatch: .*{key}: checkpoint {old[key]} vs now "
        rf"[0-9a-f]{{64}}",
        errors[0],
    ), errors
    assert committed(run) == ["step_00000004"]


# -- T11 -----------------------------------------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("name", ["../evil.mds", "/tmp/evil-reliability-t11.mds", "a/../../b.mds", "..", ".hidden"])
@pytest.mark.parametrize("field", ["raw_data", "zip_data"])
def test_t11_path_traversal_rejected_before_any_file_is_touched(name, field, data_copy, tmp_path, monkeypatch):
    ensure_streaming_importable()
    import streaming

    index_path = data_copy / "train" / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"][0][field]["basename"] = name
    index_path.write_text(json.dumps(index))
    (tmp_path / "evil.mds").write_bytes(b"sentinel outside the split directory")
    constructed = []
    monkeypatch.setattr(streaming.StreamingDataset, "__init__", lambda *a, **k: constructed.append(a))
    before = _snapshot(tmp_path)
    with pytest.raises(UnsafeShardPathError, match=rf"index\.json: shard 0 {field}: shard file name '{name}'"):
        MDSReader(str(data_copy), "train", None)
    assert constructed == [], "refused before streaming saw the index"
    assert _snapshot(tmp_path) == before, "no file created, removed or changed"
    assert not Path("/tmp/evil-reliability-t11.mds").exists()
    if field == "raw_data" and name == "../evil.mds":
        assert main(None, overrides(tmp_path / "run", data_copy)) == 2
        assert not (tmp_path / "run").exists()


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_t11_pickle_column_is_refused(tmp_path):
    ensure_streaming_importable()
    from streaming import MDSWriter

    marker = tmp_path / "MARKER"
    columns = {"tokens": "ndarray:uint16", "doc_id": "int", "piece": "int", "meta": "pkl"}
    with MDSWriter(out=str(tmp_path / "ds" / "train"), columns=columns, hashes=["xxh64"]) as writer:
        writer.write({"tokens": np.arange(10, dtype=np.uint16), "doc_id": 0, "piece": 0, "meta": _Payload(marker)})
    with pytest.raises(UnsafeColumnError, match=r"column 'meta' has encoding 'pkl'"):
        MDSReader(str(tmp_path / "ds"), "train", None)
    assert not marker.exists()

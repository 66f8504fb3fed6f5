"""The training data order (``pipeline/data/order.py``): every epoch a fresh shuffle over the whole split (shards,
then documents and sequences within blocks), checked against a naive rebuild from the reader's samples; batches as
diverse as uniform random windows; world-size invariance and exact resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import prepared_copy, write_mds
from helpers import write_mds_split

from pipeline.data.order import MIB, BlockShuffledSequences
from pipeline.data.reader import MDSReader, PackedSequences, RankBatches

SEQ, EOS = 32, 1


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> MDSReader:
    """200 Markov documents over ~50 small shards (several pieces per document)."""
    root = tmp_path_factory.mktemp("order")
    write_mds(root, "train", 200, seed=4, size_limit=1024)
    return MDSReader(str(root), "train", cache_dir=None)


def stream(reader: MDSReader, *, block_mib: float = 1, seed: int = 7) -> BlockShuffledSequences:
    return BlockShuffledSequences(reader, seq_len=SEQ, seed=seed, block_mib=block_mib, eos_id=EOS)  # type: ignore[arg-type]


def naive_epoch(reader: MDSReader, seed: int, epoch: int, block_budget: float) -> list[np.ndarray]:
    """Epoch ``epoch`` rebuilt the slow way, from ``reader.sample`` one sample at a time, with the documented rule:
    shards permuted by ``(seed, epoch)`` and grouped greedily under the budget; per block ``(seed, epoch, block)``
    permutes the segments (consecutive pieces of one document in one shard), each followed by EOS, then the
    block's whole sequences."""
    shards = np.random.default_rng([seed, epoch]).permutation(reader.num_shards)
    sizes = [s.file_pairs[0][0].bytes for s in reader.shards]
    blocks, current, size = [], [], 0
    for shard in shards:
        if current and size + sizes[shard] > block_budget:
            blocks.append(current)
            current, size = [], 0
        current.append(int(shard))
        size += sizes[shard]
    blocks.append(current)
    out = []
    for b, block in enumerate(blocks):
        segments: list[list[int]] = []
        for shard in block:
            previous = None
            for i in range(reader.shards[shard].samples):
                tokens, doc = reader.sample(shard, i)
                if doc != previous:
                    segments.append([])
                segments[-1].extend(int(t) for t in tokens)
                previous = doc
        rng = np.random.default_rng([seed, epoch, b])
        joined = [t for s in rng.permutation(len(segments)) for t in [*segments[s], EOS]]
        sequences = [joined[i * SEQ : (i + 1) * SEQ] for i in range(len(joined) // SEQ)]
        out += [np.asarray(sequences[p]) for p in rng.permutation(len(sequences))]
    return out


@pytest.mark.parametrize("block_budget", [4096, 1 << 30], ids=["many-blocks", "one-block"])
def test_two_epochs_equal_a_naive_rebuild(reader, block_budget):
    expected = naive_epoch(reader, 7, 0, block_budget) + naive_epoch(reader, 7, 1, block_budget)
    s = stream(reader, block_mib=block_budget / MIB)
    got, ids = s.next(len(expected))
    assert np.array_equal(got, np.stack(expected))
    assert ids.tolist() == list(range(len(expected)))
    assert s.epoch == 1


def test_each_epoch_uses_all_but_the_tails_of_its_blocks(reader):
    s = stream(reader, block_mib=4096 / MIB)
    total = sum(
        int(reader.sample(sh, i)[0].size) for sh in range(reader.num_shards) for i in range(reader.shards[sh].samples)
    )
    documents_pieces = naive_epoch(reader, 7, 0, 4096)
    blocks = s.blocks(0)
    assert len(blocks) > 3  # the fixture spans several blocks
    eos = sum(
        len(np.unique([reader.sample(int(sh), i)[1] for i in range(reader.shards[int(sh)].samples)]))
        for sh in range(reader.num_shards)
    )
    # what the epoch emits is what the split holds (tokens + one EOS per segment) less under one sequence per block
    assert total + eos - len(blocks) * SEQ < len(documents_pieces) * SEQ <= total + eos


def test_every_epoch_is_a_fresh_order(reader):
    """The fault this replaces: one shard (or a window shorter than a book) walked the documents in file order every
    epoch. Here the first sequences of two epochs differ, and so does the order documents first appear in."""
    s = stream(reader, block_mib=64)  # the whole split is one block
    per_epoch = len(s._layout(0, 0).sequence_order)
    first, second = s.next(per_epoch), s.next(per_epoch)
    assert s.epoch == 1
    assert not np.array_equal(first[0], second[0])
    assert {tuple(r) for r in first[0]} != {tuple(r) for r in second[0]}  # the boundaries moved too


def test_batches_are_as_diverse_as_uniform_random_windows(tmp_path):
    """Documents per global batch (PG19-shaped: long documents of several sequences each, batches of 16): the block
    order within 10% of uniform random windows over the concatenated split (the official sampler), while the old
    window order is far below. Document ``d``'s tokens are all ``d + 2``, so a batch's documents are its values."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(6 * SEQ), 0.6, 120).astype(int), SEQ // 2, None)
    write_mds_split(tmp_path / "train", [(d, 0, np.full(n, d + 2)) for d, n in enumerate(lengths)])
    reader = MDSReader(str(tmp_path), "train", cache_dir=None)
    joined = np.concatenate([np.r_[np.full(n, d + 2), EOS] for d, n in enumerate(lengths)])
    batch = 16

    def documents(seqs: np.ndarray) -> int:
        return len(np.unique(seqs[seqs != EOS]))

    uniform = np.mean(
        [
            documents(np.stack([joined[s : s + SEQ] for s in rng.integers(0, len(joined) - SEQ, batch)]))
            for _ in range(2000)
        ]
    )
    blocks = stream(reader, block_mib=64)
    window = PackedSequences(reader, seq_len=SEQ, seed=7, shuffle=True, window=64, eos_id=EOS)
    per_batch = {
        name: np.mean([documents(s.next(batch)[0]) for _ in range(30)])
        for name, s in [("blocks", blocks), ("window", window)]
    }
    assert per_batch["blocks"] >= 0.9 * uniform, (per_batch, uniform)
    assert per_batch["window"] < 0.9 * uniform, (per_batch, uniform)  # the measure tells the two orders apart


@pytest.mark.parametrize("world", [2, 3])
def test_global_batches_and_resume_whatever_the_world_size(reader, world):
    def ranks(n: int) -> list[RankBatches]:
        return [
            RankBatches(stream(reader, block_mib=4096 / MIB), global_batch=6, micro_batch=1, rank=r, world_size=n)
            for r in range(n)
        ]

    single, spread = ranks(1), ranks(world)
    for _ in range(40):  # across several blocks and into the second epoch
        one = torch.cat(single[0].next_step())
        assert torch.equal(one, torch.cat([torch.cat(rb.next_step()) for rb in spread]))
    state = single[0].state_dict()
    expected = [torch.cat(single[0].next_step()) for _ in range(30)]
    resumed = ranks(world)
    for rb in resumed:
        rb.load_state_dict(state)
    for want in expected:
        assert torch.equal(want, torch.cat([torch.cat(rb.next_step()) for rb in resumed]))


def test_a_window_checkpoint_is_refused_in_one_line_naming_the_way_back(reader):
    old = PackedSequences(reader, seq_len=SEQ, seed=7, shuffle=True, window=8, eos_id=EOS)
    old.next(3)
    with pytest.raises(ValueError, match="set data.shuffle_scope=window to resume it"):
        stream(reader).load_state_dict(old.state_dict())
    new = stream(reader)
    new.next(3)
    with pytest.raises(ValueError, match="data.shuffle_scope=blocks"):
        PackedSequences(reader, seq_len=SEQ, seed=7, shuffle=True, window=8, eos_id=EOS).load_state_dict(
            new.state_dict()
        )


def test_a_split_with_no_block_of_one_sequence_is_one_error(tmp_path: Path):
    write_mds_split(tmp_path / "train", [(d, 0, [5] * 10) for d in range(3)], size_limit=200)
    reader = MDSReader(str(tmp_path), "train", cache_dir=None)
    s = BlockShuffledSequences(reader, seq_len=4096, seed=0, block_mib=1, eos_id=EOS)
    with pytest.raises(ValueError, match="no block of the training split holds train.seq_len=4096 tokens"):
        s.next(1)


def test_a_run_reports_its_epochs_and_warns_that_it_repeats_data(tmp_path, tiny_data, overrides, metrics, caplog):
    """A real run over a 12-document split for 3+ epochs: each step's ``epoch`` in metrics.jsonl changes exactly
    where the sequences drawn pass an epoch's count (counted from the samples: tokens plus one EOS per segment, in
    whole sequences; the split is one block), the log says when the stream wraps, and the start says the run
    repeats its data."""
    from pipeline.train.trainer import main

    source = tmp_path / "source"
    write_mds(source, "train", 12, seed=5)
    write_mds(source, "val", 3, seed=6)
    shutil.copy(tiny_data / "tokenizer.model", source)
    data = prepared_copy(tmp_path, source)
    reader = MDSReader(str(data), "train", cache_dir=None)
    tokens = segments = 0
    for shard in range(reader.num_shards):
        docs = [reader.sample(shard, i)[1] for i in range(reader.shards[shard].samples)]
        tokens += sum(len(reader.sample(shard, i)[0]) for i in range(len(docs)))
        segments += len([k for k in range(len(docs)) if k == 0 or docs[k] != docs[k - 1]])
    per_epoch = (tokens + segments) // 64
    steps = 2 * per_epoch // 4 + 2  # 4 sequences a step: two epochs, then into the third
    run = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert main(None, overrides(run, data, **{"train.max_steps": steps})) == 0
    epochs = [record["epoch"] for _, record in sorted(metrics(run).items())]
    assert epochs == [(4 * step - 1) // per_epoch for step in range(1, steps + 1)]
    assert epochs[-1] == 2
    assert "the run repeats its data" in caplog.text and "each in a new order" in caplog.text
    for epoch in (1, 2):
        assert f"data: step {epochs.index(epoch) + 1} began epoch {epoch} of the training split" in caplog.text


def test_a_checkpoint_reads_back_either_order_s_position_field_by_field(reader):
    """The trainer state's ``data`` holds the position of whichever order wrote it; each is checked on read."""
    from data_prep.json_file import Fields, JsonFileError
    from pipeline.train.checkpoint import _check_data_position

    new, old = stream(reader), PackedSequences(reader, seq_len=SEQ, seed=7, shuffle=True, window=8, eos_id=EOS)
    new.next(5), old.next(5)
    for state in (new.state_dict(), old.state_dict()):
        _check_data_position(Fields(state, "state.json"))
    old_state = old.state_dict()
    old_state["cursor"]["page"] = 1
    with pytest.raises(JsonFileError, match="field 'data.cursor' does not hold exactly the keys epoch, shard_pos"):
        _check_data_position(Fields(old_state, "state.json"))
    with pytest.raises(JsonFileError, match="field 'consumed' is -2, expected an integer"):
        _check_data_position(Fields({**new.state_dict(), "consumed": -2}, "state.json"))


def test_the_window_order_reports_its_epochs_too(tmp_path, tiny_data, overrides, metrics, caplog):
    from pipeline.train.trainer import main

    source = tmp_path / "source"
    write_mds(source, "train", 12, seed=5)
    write_mds(source, "val", 3, seed=6)
    shutil.copy(tiny_data / "tokenizer.model", source)
    data = prepared_copy(tmp_path, source)
    run = tmp_path / "run"
    keys = {"train.max_steps": 14, "data.shuffle_scope": "window", "data.shuffle_window": 4}
    with caplog.at_level("INFO"):
        assert main(None, overrides(run, data, **keys)) == 0
    epochs = [record["epoch"] for _, record in sorted(metrics(run).items())]
    assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] >= 1
    first = epochs.index(1) + 1
    assert f"data: step {first} began epoch 1 of the training split" in caplog.text
    assert "the same document order every epoch" in caplog.text  # the start's warning names the order's weakness


def test_a_checkpoint_of_the_window_order_is_refused_by_today_s_default_naming_the_keys(reader, tmp_path):
    """A checkpoint from before ``data.shuffle_scope`` records a config without it, which reads as today's default
    (blocks): the resume check sees its window-order position and names the keys that resume it."""
    from pipeline.train.config import load_config
    from pipeline.train.resume_check import ResumeRefusedError, check_data_settings

    keys = [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "train.seq_len=32", "seed=7"]
    keys += ["model.chunk_size=8", "model.top_k=2"]
    cfg = load_config(None, keys)
    old = PackedSequences(reader, seq_len=SEQ, seed=7, shuffle=True, window=64, eos_id=EOS)
    with pytest.raises(ResumeRefusedError, match="add data.shuffle_scope=window data.shuffle=true to resume it"):
        check_data_settings(tmp_path, old.state_dict(), cfg)
    check_data_settings(tmp_path, old.state_dict(), load_config(None, [*keys, "data.shuffle_scope=window"]))
    check_data_settings(tmp_path, stream(reader, block_mib=64).state_dict(), cfg)

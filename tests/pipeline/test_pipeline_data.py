"""Packing: world-size invariance, exact loader resume, epochs, EOS joins, passkey needles."""

import numpy as np
import pytest
import torch
from helpers import one_family_mix

from pipeline.data.mix import sentencepiece_codec
from pipeline.data.mixture import with_tasks
from pipeline.data.reader import MDSReader, PackedSequences, RankBatches

SEQ, GLOBAL, MICRO = 64, 8, 2


@pytest.fixture(scope="module")
def reader(tiny_data):
    return MDSReader(str(tiny_data), "train", cache_dir=None)


def batches(reader, rank=0, world=1, seed=3, window=8, eos=None):
    stream = PackedSequences(reader, seq_len=SEQ, seed=seed, shuffle=True, window=window, eos_id=eos)
    return RankBatches(stream, global_batch=GLOBAL, micro_batch=MICRO, rank=rank, world_size=world)


def global_batch(rank_batches):
    """Concatenate the ranks' micro-batches in rank order: the global batch."""
    return torch.cat([torch.cat(rb.next_step()) for rb in rank_batches])


@pytest.mark.parametrize("world", [2, 4])
def test_same_global_batches_whatever_the_world_size(reader, world):
    single = batches(reader)
    ranks = [batches(reader, r, world) for r in range(world)]
    for _ in range(6):
        one = torch.cat(single.next_step())
        assert one.shape == (GLOBAL, SEQ)
        assert torch.equal(one, global_batch(ranks))
    assert {len(rb.next_step()) for rb in ranks} == {GLOBAL // world // MICRO}


def test_ranks_get_disjoint_sequences(reader):
    r0, r1 = batches(reader, 0, 2), batches(reader, 1, 2)
    a, b = torch.cat(r0.next_step()), torch.cat(r1.next_step())
    assert not any(torch.equal(x, y) for x in a for y in b)


def test_seed_changes_order_and_stream_is_contiguous_text(reader):
    a, b = torch.cat(batches(reader, seed=1).next_step()), torch.cat(batches(reader, seed=2).next_step())
    assert not torch.equal(a, b)
    unshuffled = PackedSequences(reader, seq_len=SEQ, seed=0, shuffle=False, window=4, eos_id=None)
    seqs, ids = unshuffled.next(3)
    first_tokens = np.concatenate([reader.sample(0, i)[0] for i in range(8)]).astype(np.int64)
    assert np.array_equal(seqs.reshape(-1), first_tokens[: 3 * SEQ]) and ids.tolist() == [0, 1, 2]


def test_loader_state_resumes_exactly_even_on_another_world_size(reader):
    straight = batches(reader)
    for _ in range(3):
        straight.next_step()
    state = straight.state_dict()
    expected = [torch.cat(straight.next_step()) for _ in range(4)]
    resumed = batches(reader)
    resumed.load_state_dict(state)
    assert all(torch.equal(e, torch.cat(resumed.next_step())) for e in expected)
    ranks = [batches(reader, r, 2) for r in range(2)]
    for rb in ranks:
        rb.load_state_dict(state)
    assert all(torch.equal(e, global_batch(ranks)) for e in expected)


def test_resume_rejects_a_different_stream(reader):
    state = batches(reader).state_dict()
    with pytest.raises(ValueError, match="checkpoint has seed=3, the config gives 4"):
        batches(reader, seed=4).load_state_dict(state)


def test_epochs_cover_every_token_and_continue(reader):
    total = int(
        sum(len(reader.sample(s, i)[0]) for s in range(reader.num_shards) for i in range(reader.samples_per_shard[s]))
    )
    stream = PackedSequences(reader, seq_len=SEQ, seed=0, shuffle=True, window=4, eos_id=None)
    n_seq = total // SEQ
    seqs, _ = stream.next(n_seq + 5)  # crosses into epoch 1 without error
    epoch0 = np.sort(seqs[: total // SEQ].reshape(-1))
    everything = np.sort(
        np.concatenate(
            [reader.sample(s, i)[0] for s in range(reader.num_shards) for i in range(reader.samples_per_shard[s])]
        ).astype(np.int64)
    )
    assert np.array_equal(np.bincount(epoch0, minlength=64) <= np.bincount(everything, minlength=64), np.ones(64, bool))
    assert stream.state_dict()["cursor"]["epoch"] == 1


def test_eos_between_documents_only(reader):
    stream = PackedSequences(reader, seq_len=SEQ, seed=0, shuffle=False, window=2, eos_id=63)
    flat = stream.next(20)[0].reshape(-1)
    docs = [d for d in _docs_in_shard_order(reader)]
    n_boundaries = np.searchsorted(np.cumsum([len(d) + 1 for d in docs]), len(flat), side="right")
    assert (flat == 63).sum() >= n_boundaries
    first_doc = docs[0]
    assert np.array_equal(flat[: len(first_doc)], first_doc) and flat[len(first_doc)] == 63


def _docs_in_shard_order(reader):
    doc, current = [], None
    for s in range(reader.num_shards):
        for i in range(reader.samples_per_shard[s]):
            toks, d = reader.sample(s, i)
            if current is not None and d != current:
                yield np.concatenate(doc)
                doc = []
            doc.append(toks.astype(np.int64))
            current = d
        # a shard end also ends the document in the stream (shards are shuffled independently)
        yield np.concatenate(doc)
        doc, current = [], None


def test_needles_are_deterministic_and_well_formed(reader, tiny_data):
    needles = one_family_mix(tiny_data / "tokenizer.model", SEQ * 2, 16, fraction=0.5)
    decode = sentencepiece_codec(tiny_data / "tokenizer.model").decode
    stream = PackedSequences(reader, seq_len=SEQ * 2, seed=0, shuffle=True, window=8, eos_id=None)
    tasks = with_tasks(stream, needles.fraction)
    rb = RankBatches(tasks, global_batch=GLOBAL, micro_batch=MICRO, rank=0, world_size=1, mix=needles, seed=9)
    batch = torch.cat(rb.next_step())
    assert batch.shape == (GLOBAL, SEQ * 2)
    marked = 0
    for row in batch.numpy():
        text = decode(row.tolist())
        if "pass key is" in text:
            marked += 1
            key = text.split("The pass key is")[1].split(".")[0].strip()
            assert f"What is the pass key? The pass key is {key}" in text
    assert 0 < marked < GLOBAL
    stream2 = PackedSequences(reader, seq_len=SEQ * 2, seed=0, shuffle=True, window=8, eos_id=None)
    tasks2 = with_tasks(stream2, needles.fraction)
    rank1 = RankBatches(tasks2, global_batch=GLOBAL, micro_batch=MICRO, rank=1, world_size=2, mix=needles, seed=9)
    assert torch.equal(torch.cat(rank1.next_step()), batch[GLOBAL // 2 :])

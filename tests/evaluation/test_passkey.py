"""The passkey protocol: needle at the requested depth, no answer leak, oracle = 100 %, random = chance."""

import numpy as np
import pytest
from eval_stubs import InductionOracle, RandomDigits, Recorder
from helpers import grid_samples_with_picks, tiny_config

from pipeline.data.needle import NEEDLE, NeedleSpec
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import PasskeyGrid, build_sample, evaluate_passkey, predict_answer
from pipeline.evaluation.runtime import StreamBudget
from pipeline.evaluation.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def source():
    return TokenSource("builtin", TOK, seed=0)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_single_needle_at_requested_depth(source, depth):
    sample = build_sample(
        source, TOK, NeedleSpec("single"), length=2000, depth=depth, rng=np.random.default_rng(1), chunk_size=16
    )
    assert len(sample.ids) == 2000
    assert (sample.answer_start - 1) % 16 == 0  # the question's last token opens a chunk, as in training
    assert 0 <= round(depth * sample.room) - sample.needle_start < 16
    if sample.needle_len <= 16:  # a needle that fits a chunk never straddles two
        assert sample.needle_start // 16 == (sample.needle_start + sample.needle_len - 1) // 16
    needle = TOK.decode(sample.ids[sample.needle_start : sample.needle_start + sample.needle_len].tolist())
    assert needle == NEEDLE.format(key=sample.key)  # the trainer's needle-mix text
    answer_end = sample.answer_start + sample.answer_len
    assert TOK.decode(sample.ids[sample.answer_start - 40 : answer_end].tolist()).endswith(f"key is {sample.key}")
    # the space before the digits went into the question: the scored answer is the key itself
    assert TOK.decode(sample.ids[sample.answer_start : answer_end].tolist()) == sample.key


@pytest.mark.parametrize("variant", ["multikey", "multihop"])
def test_multi_variants_layout(source, variant):
    spec = NeedleSpec(variant, needles=4)
    # bytes: the two-hop question's words after the name (29 bytes) must fit a chunk plus one token
    chunk_size = 16 if variant == "multikey" else 32
    sample = build_sample(
        source, TOK, spec, length=3000, depth=0.5, rng=np.random.default_rng(2), chunk_size=chunk_size
    )
    text = TOK.decode(sample.ids.tolist())
    assert len(sample.ids) == 3000
    assert text.count(sample.key) == 2  # once in its needle, once as the answer
    if variant == "multikey":
        assert text.count("special magic number") == 4 + 2  # needles + question
    else:
        assert text.count(" has pass key ") == 2 and text.count("The pass key there is") == 1
        assert text.count(" leads to ") == 2  # target chain + one distractor chain
    needle = TOK.decode(sample.ids[sample.needle_start : sample.needle_start + sample.needle_len].tolist())
    assert sample.key in needle


def test_answer_never_in_the_input(source):
    model = Recorder()
    sample = build_sample(
        source, TOK, NeedleSpec("single"), length=1500, depth=0.5, rng=np.random.default_rng(3), chunk_size=16
    )
    predicted = predict_answer(model, sample, budget=StreamBudget(segment=256))
    fed = model.last_state.seen
    assert fed[: sample.answer_start] == sample.ids[: sample.answer_start].tolist()
    # after the prefix, only the model's own predictions were fed back (all but the last one)
    assert fed[sample.answer_start :] == predicted[:-1]
    assert len(fed) == sample.answer_start + sample.answer_len - 1


@pytest.mark.parametrize("variant", ["single", "multikey"])
def test_copying_oracle_scores_100(source, variant):
    rows = evaluate_passkey(
        InductionOracle(),
        TOK,
        source,
        PasskeyGrid(NeedleSpec(variant), lengths=[512, 2048], depths=[0.0, 0.5, 1.0], samples=3, seed=0),
        budget=StreamBudget(segment=300),
    )
    assert [(r["length"], r["depth"]) for r in rows] == [(L, d) for L in (512, 2048) for d in (0.0, 0.5, 1.0)]
    assert all(r["accuracy"] == 1.0 and r["exact_match"] == 1.0 and r["n"] == 3 for r in rows)


def test_random_model_scores_chance(source):
    rows = evaluate_passkey(
        RandomDigits(),
        TOK,
        source,
        PasskeyGrid(NeedleSpec("single"), lengths=[160], depths=[0.5], samples=300, seed=0),
    )
    # first key digit is uniform over 1..9, the guess over 0..9: expected accuracy 0.1, 300 draws
    assert 0.04 < rows[0]["accuracy"] < 0.17
    assert rows[0]["exact_match"] < 0.01


def test_length_too_short_for_needle(source):
    with pytest.raises(ValueError, match="a sequence of 64 tokens cannot hold a passkey needle"):
        build_sample(
            source, TOK, NeedleSpec("single"), length=64, depth=0.5, rng=np.random.default_rng(0), chunk_size=16
        )


def test_short_corpus_is_an_error(tmp_path):
    corpus = tmp_path / "book.txt"
    corpus.write_text("A short book. " * 50)
    src = TokenSource(str(corpus), TOK)
    with pytest.raises(ValueError, match="fewer than the .* haystack tokens"):
        build_sample(
            src, TOK, NeedleSpec("single"), length=4096, depth=0.5, rng=np.random.default_rng(0), chunk_size=16
        )
    build_sample(
        src, TOK, NeedleSpec("single"), length=600, depth=0.5, rng=np.random.default_rng(0), chunk_size=16
    )  # fits


def test_bad_template_names_the_key(source):
    with pytest.raises(ValueError, match="needle=.*unknown placeholder"):
        build_sample(
            source,
            TOK,
            NeedleSpec("single", needle="key {kye}"),
            length=512,
            depth=0.5,
            rng=np.random.default_rng(0),
            chunk_size=16,
        )


def test_real_model_prediction_is_the_greedy_full_forward_continuation(source, tiny_model):
    """The shared prefill + decode loop (memory_only far prefix, streamed segments, fed-back tokens) predicts
    what repeated full forwards predict."""
    import torch

    sample = build_sample(
        source, TOK, NeedleSpec("single"), length=400, depth=0.3, rng=np.random.default_rng(4), chunk_size=16
    )
    predicted = predict_answer(tiny_model, sample, budget=StreamBudget(segment=64))
    ids = sample.ids[: sample.answer_start].tolist()
    for _ in range(sample.answer_len):
        with torch.no_grad():
            ids.append(int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert predicted == ids[sample.answer_start :]
    assert tiny_model.window_reach is not None and sample.answer_start > tiny_model.window_reach + 64


def test_records_whether_the_question_fetched_the_needle(source, monkeypatch):
    """Each row counts the samples whose question retrieval (the row of landmark ``c - 1``, ``c`` the chunk
    predicting the first answer token) held the needle's chunk, as a batch forward of the same sample picks it:
    the split of a wrong answer into a retrieval and a copy error (six look-alike needles, so that a random model
    fetches the asked one in some samples and not in others)."""
    import torch

    from model import GCAForCausalLM

    torch.manual_seed(0)
    model = GCAForCausalLM(tiny_config(vocab_size=256, chunk_size=16, top_k=2)).eval()
    grid = PasskeyGrid(NeedleSpec("multikey", needles=6), [1500], [0.0, 0.5, 1.0], 4, seed=3)
    rows = evaluate_passkey(model, TOK, source, grid, budget=StreamBudget(segment=48))
    fetched = []
    for row, drawn in zip(rows, grid_samples_with_picks(model, source, TOK, grid, monkeypatch), strict=True):
        hits = sum(
            bool(sample.asked_chunks & set(picks[(0, (sample.answer_start - 1) // 16 - 1)][0]))
            for sample, picks in drawn
        )
        assert row["retrieval"] == {"g0": {"asked_needle": {"hits": hits, "n": grid.samples}}}
        fetched.append(hits)
    assert 0 < sum(fetched) < grid.samples * len(grid.depths)  # both outcomes occur, so the check can tell them apart


def test_no_retrieval_record_without_retrieval(source):
    from model import build_model

    model = build_model(tiny_config(vocab_size=256, arch="swa")).eval()
    grid = PasskeyGrid(NeedleSpec("single"), [200], [0.5], 2, seed=0)
    (row,) = evaluate_passkey(model, TOK, source, grid)
    assert "retrieval" not in row

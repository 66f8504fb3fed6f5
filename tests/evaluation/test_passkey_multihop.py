"""``--task passkey variant=multihop``: its samples follow the two-hop layout's definition, with the trainer's texts.

The structural checker is the one the trainer's tests use (``tests/pipeline/test_needle_multihop.py``), so a
trainer-inserted sequence and an eval sample are held to the same rules by the same code.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import grid_samples_with_picks, insert_task, one_family_mix

from pipeline.data.needle import HOP_TEMPLATES, TEMPLATES, HopChunks, NeedleSpec, check_templates
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import PasskeyGrid, build_sample
from pipeline.evaluation.runtime import StreamBudget
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer

_spec = importlib.util.spec_from_file_location(
    "needle_multihop_checks", Path(__file__).resolve().parents[1] / "pipeline" / "test_needle_multihop.py"
)
assert _spec is not None and _spec.loader is not None
checks = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = checks  # its dataclasses look their module up there
_spec.loader.exec_module(checks)

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def source():
    return TokenSource("builtin", TOK, seed=0)


@pytest.fixture(scope="module")
def hop_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hop_tok") / "tokenizer.model"
    path.write_bytes(checks.hop_tokenizer_bytes())
    return path


def test_eval_uses_the_trainers_texts():
    assert TEMPLATES["multihop"] is HOP_TEMPLATES
    spec = NeedleSpec("multihop")
    assert {part: spec.template(part) for part in HOP_TEMPLATES} == HOP_TEMPLATES
    check_templates(spec)


@pytest.mark.parametrize("length,S", [(1000, 28), (2000, 32), (4000, 64)])
@pytest.mark.parametrize("needles", [4, 6])
def test_samples_follow_the_definition(source, length, S, needles):
    spec = NeedleSpec("multihop", needles=needles)
    link_before = link_after = 0
    for seed in range(12):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            sample = build_sample(
                source, TOK, spec, length=length, depth=depth, rng=np.random.default_rng([seed, length]), chunk_size=S
            )
            assert len(sample.ids) == length
            got = checks.check_two_hop(
                sample.ids, TOK.encode, TOK.decode, S, sample.answer_start, sample.answer_len, chains=needles // 2
            )
            assert len(got.distractors) == needles // 2 - 1
            assert sample.key == got.key and len(sample.key) == spec.key_digits
            # bytes: the space before the digits went into the question, the scored answer is the key itself
            assert TOK.decode(sample.ids[sample.answer_start : sample.answer_start + sample.answer_len].tolist()) == (
                sample.key
            )
            assert (sample.needle_start, sample.needle_len) == got.asked.needle
            assert sample.room == got.question_start // S * S - sample.needle_len
            assert sample.needle_start // S == round(depth * sample.room) // S, (
                depth,
                sample.room,
                sample.needle_start,
            )
            link_before += got.asked.link[0] < got.asked.needle[0]
            link_after += got.asked.link[0] > got.asked.needle[0]
            assert sample.hop == _expected_hop_chunks(got, S)
    assert link_before and link_after


def _expected_hop_chunks(got, S: int) -> HopChunks:
    """The chunks the checker found each part in (``(start, length)`` spans located from the decoded text)."""

    def chunks(*spans: tuple[int, int]) -> frozenset[int]:
        return frozenset(p // S for start, n in spans for p in range(start, start + n))

    return HopChunks(
        answer=(got.answer_start - 1) // S,
        link=chunks(got.asked.link),
        key=chunks(got.asked.needle),
        distractor_links=chunks(*(c.link for c in got.distractors)),
        distractor_keys=chunks(*(c.needle for c in got.distractors)),
    )


def test_which_hops_a_groups_picks_followed():
    hop = HopChunks(
        answer=20,
        link=frozenset({3}),
        key=frozenset({9, 10}),
        distractor_links=frozenset({5}),
        distractor_keys=frozenset({14}),
    )
    picks = {
        (0, 18): [[3, 7]],  # the row after the name holds the link
        (0, 19): [[10, 2]],  # the answer's row holds the key needle's second chunk only
        (1, 18): [[5]],  # the distractor's link instead
        (1, 19): [[14, 9]],  # both key needles
        (0, 17): [[9, 14]],  # another row: not looked at
    }
    assert hop.followed(picks) == {
        "g0": {
            "first_hop_link": True,
            "first_hop_distractor_link": False,
            "second_hop_key": True,
            "second_hop_distractor_key": False,
        },
        "g1": {
            "first_hop_link": False,
            "first_hop_distractor_link": True,
            "second_hop_key": True,
            "second_hop_distractor_key": True,
        },
    }
    # rows the streamed prefix never scored give no entry rather than a miss
    assert hop.followed({(0, 19): [[14]]}) == {"g0": {"second_hop_key": False, "second_hop_distractor_key": True}}
    assert hop.followed({}) == {}


def test_trainer_and_eval_lay_out_the_same_structure(hop_model):
    """The same tokenizer and chunk size: a trainer needle sequence and an eval sample pass the same checker, with
    the question and answer at the same places and the same question tokens."""
    L, S = 1024, 16
    trainer = one_family_mix(hop_model, L, S, "multihop")
    tok = ModelTokenizer(hop_model)
    source = TokenSource("builtin", tok, seed=0)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        ids, answer = insert_task(trainer, np.asarray(source.window(L, rng), dtype=np.int64), rng)
        train = checks.check_two_hop(ids, tok.encode, tok.decode, S, answer.start, answer.stop - answer.start, 2)
        sample = build_sample(
            source, tok, NeedleSpec("multihop"), length=L, depth=float(rng.random()), rng=rng, chunk_size=S
        )
        ev = checks.check_two_hop(sample.ids, tok.encode, tok.decode, S, sample.answer_start, sample.answer_len, 2)
        assert (train.answer_start, train.tail_start, train.head_end) == (ev.answer_start, ev.tail_start, ev.head_end)
        assert (
            ids[train.tail_start : train.answer_start].tolist() == sample.ids[ev.tail_start : ev.answer_start].tolist()
        )
        assert answer.stop - answer.start == sample.answer_len
        for got, seq in ((train, ids), (ev, sample.ids)):
            # The decoded sentences are the templates' sentences, names and keys filled in.
            for template, (start, n) in (("link", got.asked.link), ("needle", got.asked.needle)):
                text = tok.decode(seq[start : start + n].tolist())
                assert checks.sentence_regex(HOP_TEMPLATES[template]).fullmatch(text), text


def test_byte_tail_needs_a_chunk_of_28(source):
    """The default question's words after the name are 29 bytes (with the answer's space): a chunk plus one."""
    spec = NeedleSpec("multihop")
    sample = build_sample(source, TOK, spec, length=1500, depth=0.5, rng=np.random.default_rng(0), chunk_size=28)
    got = checks.check_two_hop(sample.ids, TOK.encode, TOK.decode, 28, sample.answer_start, sample.answer_len, 2)
    assert got.answer_start - got.tail_start == 29 and got.tail_start == got.head_end  # head, then tail at once
    with pytest.raises(ValueError, match="take 29 tokens; with chunk_size=27 at most 28 fit"):
        build_sample(source, TOK, spec, length=1500, depth=0.5, rng=np.random.default_rng(0), chunk_size=27)


def test_question_too_long_after_the_name(source):
    spec = NeedleSpec("multihop", question=" Where does {name} lead? Tell me the pass key that you find there:")
    with pytest.raises(
        ValueError,
        match="with chunk_size=32 at most 33 fit between the name's chunk and the answer: shorten the question",
    ):
        build_sample(source, TOK, spec, length=3000, depth=0.5, rng=np.random.default_rng(0), chunk_size=32)


def test_too_short_length(source):
    with pytest.raises(ValueError, match="a sequence of 150 tokens with chunk_size=32 has too few free chunks"):
        build_sample(
            source, TOK, NeedleSpec("multihop"), length=150, depth=0.5, rng=np.random.default_rng(0), chunk_size=32
        )


@pytest.mark.parametrize(
    "question, error",
    [
        (" Where does it lead? The pass key there is", "lacks the placeholder(s) {name}"),
        (" The pass key there is the one of {name}", "needs words after {name}"),
    ],
)
def test_bad_question_refused_before_any_work(question, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        check_templates(NeedleSpec("multihop", question=question))


def test_question_naming_the_chain_twice(source):
    """A question template with ``{name}`` twice passes ``check_templates``; the sample must then be built (the
    tail names the chain again) or refused as bad input (a ``ValueError``), never crash with another error."""
    spec = NeedleSpec("multihop", question=" Where does {name} lead? The key {name} leads to is")
    check_templates(spec)
    try:
        build_sample(source, TOK, spec, length=4000, depth=0.5, rng=np.random.default_rng(1), chunk_size=64)
    except ValueError:
        pass


def test_eval_counts_the_hops_each_group_followed(source, monkeypatch):
    """The two-hop eval's ``retrieval`` counts, from picks recorded while streaming in segments, equal
    ``HopChunks.followed`` of the picks a batch forward of the same samples makes."""
    import torch
    from helpers import tiny_config

    from model import GCAForCausalLM
    from pipeline.evaluation.passkey import evaluate_passkey

    torch.manual_seed(0)
    model = GCAForCausalLM(tiny_config(vocab_size=256, groups=[1, 1], chunk_size=32, top_k=2)).eval()
    grid = PasskeyGrid(NeedleSpec("multihop", needles=6), [1200], [0.2, 0.9], 3, seed=5)
    rows = evaluate_passkey(model, TOK, source, grid, budget=StreamBudget(segment=100))

    for row, drawn in zip(rows, grid_samples_with_picks(model, source, TOK, grid, monkeypatch), strict=True):
        want: dict[str, dict[str, dict[str, int]]] = {}
        for sample, picks in drawn:
            assert len({g for g, _ in picks}) == 2
            for group, hops in sample.hop.followed(picks).items():
                assert set(hops) == {
                    "first_hop_link",
                    "first_hop_distractor_link",
                    "second_hop_key",
                    "second_hop_distractor_key",
                }
                for check, hit in hops.items():
                    count = want.setdefault(group, {}).setdefault(check, {"hits": 0, "n": 0})
                    count["hits"] += hit
                    count["n"] += 1
        assert row["retrieval"] == want

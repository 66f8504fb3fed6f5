"""Chunk-aligned passkey layout: the needle never straddles chunks, the answer is predicted from a chunk start."""

import numpy as np
import pytest
from helpers import insert_task, one_family_mix

from pipeline.data.mix import sentencepiece_codec
from pipeline.data.needle import NeedleSpec, lay_out_needle, move_answer_whitespace, needle_parts, place_needle


@pytest.mark.parametrize("length,S", [(256, 16), (1000, 16), (4096, 64), (300, 7)])
@pytest.mark.parametrize("depth", [0.0, 0.13, 0.5, 0.77, 1.0])
def test_layout_rules(length, S, depth):
    needle_len, question_len, answer_len = 6, 12, 5
    p = place_needle(length, S, needle_len, question_len, answer_len, depth)
    assert (p.answer_start - 1) % S == 0  # the question's last token opens a chunk
    assert p.answer_start + answer_len <= length
    assert p.answer_start + answer_len + S > length  # ... the last such chunk
    assert p.question_start == p.answer_start - question_len
    assert 0 <= p.needle_start and p.needle_start + needle_len <= p.question_start
    assert p.needle_start // S == (p.needle_start + needle_len - 1) // S  # one chunk
    room = p.question_start - needle_len
    assert abs(p.needle_start - depth * room) < S  # at the requested depth, up to the chunk snap


def test_too_short_raises():
    with pytest.raises(ValueError, match="cannot hold a passkey needle"):
        place_needle(20, 16, 6, 12, 5, 0.5)


def test_inserter_writes_key_at_both_places(tiny_data):
    ins = one_family_mix(tiny_data / "tokenizer.model", 256, chunk_size=16)
    codec = sentencepiece_codec(tiny_data / "tokenizer.model")
    seq = np.zeros(256, dtype=np.int64) + 5
    out, answer_span = insert_task(ins, seq, np.random.default_rng(0))
    assert out.shape == seq.shape and (seq == 5).all()  # a copy; the input is untouched
    text = codec.decode(out.tolist())
    key = text.split("The pass key is")[1].split(".")[0].strip()
    assert len(key) == 5 and key.isdigit()
    assert f"The pass key is {key}" in text.split("What is")[1]
    needle, question, answer = needle_parts(NeedleSpec(), codec.encode, codec.decode, key)
    assert codec.decode(answer[:1]).strip() == key[0]  # the first answer token is a digit, not a space
    assert out[answer_span].tolist() == answer


def test_answer_whitespace_moves_to_the_question_keeping_one_answer_token():
    vocab = {1: "?", 2: " ", 3: "\t", 4: "12", 5: "345"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert move_answer_whitespace([1], [2, 3, 4, 5], decode) == ([1, 2, 3], [4, 5])
    assert move_answer_whitespace([1], [4, 2, 5], decode) == ([1], [4, 2, 5])  # only leading whitespace moves
    assert move_answer_whitespace([1], [2, 3], decode) == ([1, 2], [3])  # never an empty answer
    question, answer = [1], [2, 4]
    move_answer_whitespace(question, answer, decode)
    assert (question, answer) == ([1], [2, 4])  # the inputs are left as they were


def test_lay_out_needle_writes_every_part_where_place_needle_says_and_keeps_distractors_apart():
    seq = np.full(400, 7, dtype=np.int64)
    needle, question, answer = [1] * 6, [2] * 9, [3] * 4
    others = [[4] * 5, [5] * 5, [6] * 5]
    out, where = lay_out_needle(
        seq, needle, question, answer, depth=0.4, chunk_size=16, others=others, rng=np.random.default_rng(0)
    )
    assert where == place_needle(400, 16, 6, 9, 4, 0.4)  # the layout is place_needle's, nothing added
    assert (seq == 7).all()  # a copy
    assert out[where.needle_start : where.needle_start + 6].tolist() == needle
    assert out[where.question_start : where.answer_start].tolist() == question
    assert out[where.answer_start : where.answer_start + 4].tolist() == answer
    for token in (4, 5, 6):  # each distractor whole, before the question, overwriting neither needle nor another
        at = np.flatnonzero(out == token)
        assert len(at) == 5 and at[-1] - at[0] == 4 and at[-1] < where.question_start

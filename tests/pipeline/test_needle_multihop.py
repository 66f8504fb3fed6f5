"""Two-hop needle mix (``data.needle_variant=multihop``): the layout checked against its definition.

The definition (``pipeline/data/needle.py``): the answer starts right after the first token of the last chunk ``c`` that
leaves room for it; the question's head, ending with the chain's first name, ends with the last token of chunk
``c - 2``; its tail ends with the first token of chunk ``c``; every needle (the asked key needle at the requested
depth, the asked link, each distractor chain's link and key needle) lies in chunks that no other needle and no
part of the question touches, and a needle that fits in a chunk never straddles two.

``check_two_hop`` finds everything in a finished token sequence from the decoded text and the templates alone
(no layout numbers from the code under test) and checks that definition; the eval's tests
(``tests/evaluation/test_passkey_multihop.py``) run the same checker on its samples.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import insert_task, one_family_mix, train_test_tokenizer

from pipeline.data.mixture import with_tasks
from pipeline.data.needle import (
    HOP_TEMPLATES,
    SYLLABLES,
    hop_texts,
    lay_out_multihop,
    place_hop_question,
    split_question,
)
from pipeline.data.reader import MDSReader, PackedSequences, RankBatches
from pipeline.evaluation.haystack import WORDS
from pipeline.train.config import ConfigError, load_config
from pipeline.train.inputs import check_inputs

NAME = r"([A-Z][a-z]+)"


# ---------------------------------------------------------------- a tokenizer that knows every character


def hop_tokenizer_bytes() -> bytes:
    """A 200-piece SentencePiece model covering every character of the two-hop texts, the names and the eval's
    filler words, so that decoding is lossless (up to whitespace) and distinct names get distinct ids."""
    rng = np.random.default_rng(0)

    def name() -> str:
        return "".join(rng.choice(SYLLABLES, 2)).capitalize()

    lines = []
    for _ in range(600):
        first, second, key = name(), name(), str(rng.integers(10_000, 100_000))
        lines.append(
            " ".join(rng.choice(WORDS, 10)).capitalize()
            + "."
            + HOP_TEMPLATES["link"].format(name=first, next=second)
            + HOP_TEMPLATES["needle"].format(name=second, key=key)
            + HOP_TEMPLATES["question"].format(name=first)
            + HOP_TEMPLATES["answer"].format(key=key)
        )
    return train_test_tokenizer(lines, 200, character_coverage=1.0, byte_fallback=False)


@pytest.fixture(scope="module")
def hop_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hop_tok") / "tokenizer.model"
    path.write_bytes(hop_tokenizer_bytes())
    return path


@pytest.fixture(scope="module")
def sp(hop_model):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(hop_model))


# ---------------------------------------------------------------- the independent checker


def sentence_regex(template: str) -> re.Pattern[str]:
    """A template as a regex over decoded text (whitespace collapsed, as SentencePiece decodes it): names are
    capitalized words, keys digits."""
    rx = re.escape(" ".join(template.split()))
    for field, group in (("name", NAME), ("next", NAME), ("key", r"(\d+)")):
        rx = rx.replace(re.escape("{" + field + "}"), group)
    return re.compile(rx)


def find_all(hay: np.ndarray, needle: list[int]) -> list[int]:
    """Every start of ``needle`` as a contiguous run in ``hay``."""
    if len(needle) > len(hay):
        return []
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(hay), len(needle))
    return np.flatnonzero((windows == np.asarray(needle)).all(axis=1)).tolist()


def chunks_of(start: int, n: int, S: int) -> set[int]:
    return {t // S for t in range(start, start + n)}


@dataclass
class Chain:
    first: str
    second: str
    key: str
    link: tuple[int, int]
    """(start, length) of the link "first leads to second"."""
    needle: tuple[int, int]
    """(start, length) of the key needle "second has pass key key"."""


@dataclass
class TwoHop:
    question_start: int
    head_end: int
    tail_start: int
    answer_start: int
    key: str
    asked: Chain
    distractors: list[Chain]


def check_two_hop(
    ids: np.ndarray,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    S: int,
    answer_start: int,
    answer_len: int,
    chains: int,
    templates: dict[str, str] = HOP_TEMPLATES,
) -> TwoHop:
    """Check one finished two-hop sequence against the layout's definition; return what it found."""
    ids = np.asarray(ids)
    L = len(ids)
    # The answer: after the first token of the last chunk that leaves room for it.
    assert answer_start == max(a for a in range(1, L, S) if a + answer_len <= L)
    assert (answer_start - 1) % S == 0
    answer = ids[answer_start : answer_start + answer_len].tolist()
    key = decode(answer).strip()
    assert re.fullmatch(r"\d+", key), key
    # The answer's leading whitespace tokens (if any) went to the end of the question.
    full = encode(templates["answer"].format(key=key))
    lead = 0
    while lead < len(full) - 1 and not decode(full[lead : lead + 1]).strip():
        lead += 1
    assert answer == full[lead:]
    cut = templates["question"].index("{name}") + len("{name}")
    head_t, tail_t = templates["question"][:cut], templates["question"][cut:]
    tail = encode(tail_t) + full[:lead]
    tail_start = answer_start - len(tail)
    assert ids[tail_start:answer_start].tolist() == tail
    c = (answer_start - 1) // S  # the answer's chunk; the tail's last token is its first
    assert {t // S for t in range(tail_start, answer_start)} <= {c - 1, c}
    # The head ends with the name, with the last token of chunk c - 2.
    head_end = answer_start - 1 - S
    assert head_end % S == 0 and (head_end - 1) // S == c - 2
    found = re.search(sentence_regex(head_t).pattern + "$", decode(ids[max(0, head_end - 64) : head_end].tolist()))
    assert found, decode(ids[max(0, head_end - 64) : head_end].tolist())
    asked_name = found.group(1)
    head = encode(head_t.format(name=asked_name))
    question_start = head_end - len(head)
    assert question_start >= 0 and ids[question_start:head_end].tolist() == head
    # The needles: every link and key needle in the text before the question, each written once, whole.
    before = ids[:question_start]
    text = decode(before.tolist())
    links = sentence_regex(templates["link"]).findall(text)
    keyed = sentence_regex(templates["needle"]).findall(text)
    assert len(links) == chains and len(keyed) == chains, (links, keyed)
    key_of = dict(keyed)
    assert len(key_of) == chains  # one key needle per name

    def span(template: str, **values: str) -> tuple[int, int]:
        part = encode(template.format(**values))
        starts = find_all(before, part)
        assert len(starts) == 1, (template, values, starts)
        return starts[0], len(part)

    found_chains = []
    for first, second in links:
        assert second in key_of, (first, second, key_of)  # every link leads to a key needle
        found_chains.append(
            Chain(
                first,
                second,
                key_of[second],
                span(templates["link"], name=first, next=second),
                span(templates["needle"], name=second, key=key_of[second]),
            )
        )
    asked = [ch for ch in found_chains if ch.first == asked_name]
    assert len(asked) == 1, (asked_name, links)
    distractors = [ch for ch in found_chains if ch.first != asked_name]
    # The asked chain: question's name -> link -> key needle's name -> the answer's key.
    assert asked[0].key == key
    names = [n for ch in found_chains for n in (ch.first, ch.second)]
    assert len(set(names)) == 2 * chains, names  # distractor chains use other names ...
    assert all(ch.key != key for ch in distractors)  # ... and other keys
    # Chunks: each needle alone in its chunk(s), none touching the question (head, gap, tail, answer).
    question_chunks = set(range(question_start // S, -(-L // S)))
    taken: set[int] = set()
    for start, n in [part for ch in found_chains for part in (ch.link, ch.needle)]:
        mine = chunks_of(start, n, S)
        if n <= S:
            assert len(mine) == 1, (start, n, S)  # never straddles
        else:
            assert (start + n) % S == 0, (start, n, S)  # ends with its last chunk
        assert not mine & taken, (start, n, sorted(taken))
        assert not mine & question_chunks, (start, n, question_start, S)
        taken |= mine
    return TwoHop(question_start, head_end, tail_start, answer_start, key, asked[0], distractors)


def _key_maker(rng: np.random.Generator) -> Callable[[], str]:
    return lambda: str(int(rng.integers(10_000, 100_000)))


def filler(sp, n: int) -> np.ndarray:
    """``n`` tokens of plain words (no capital letters, so no needle can be imitated)."""
    words = sp.encode(" ".join(WORDS[:40]))
    return np.resize(np.asarray(words, dtype=np.int64), n)


def needle_positions(ids_len: int, layout: TwoHop) -> np.ndarray:
    """True at every token written by the layout."""
    mask = np.zeros(ids_len, dtype=bool)
    for ch in [layout.asked, *layout.distractors]:
        for start, n in (ch.link, ch.needle):
            mask[start : start + n] = True
    mask[layout.question_start : layout.head_end] = True
    mask[layout.tail_start :] = True  # tail, answer and the haystack after it (checked separately)
    return mask


# ---------------------------------------------------------------- 1, 2: the layout over many seeds


@pytest.mark.parametrize("L,S", [(256, 8), (384, 12), (512, 16), (1024, 16), (1024, 32)])
def test_lay_out_multihop_follows_the_definition(sp, L, S):
    link_before = link_after = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        key = str(int(rng.integers(10_000, 100_000)))
        texts = hop_texts(sp.encode, sp.decode, HOP_TEMPLATES, key, _key_maker(rng), rng)
        depth = {0: 0.0, 1: 1.0, 2: 0.5}.get(seed, float(rng.random()))
        seq = filler(sp, L)
        out, where = lay_out_multihop(seq, texts, S, depth, rng)
        assert (seq == filler(sp, L)).all() and out.shape == seq.shape  # a copy
        got = check_two_hop(out, sp.encode, sp.decode, S, where.answer_start, len(texts.answer), chains=2)
        assert got.key == key
        # The placement it reports is what was written.
        assert (where.question_start, where.tail_start) == (got.question_start, got.tail_start)
        assert where.needle_start == got.asked.needle[0] and where.others[0] == got.asked.link[0]
        assert sorted(where.others[1:]) == sorted(p[0] for ch in got.distractors for p in (ch.link, ch.needle))
        # The asked key needle in the chunk holding round(depth * room), at any offset that keeps it inside; one
        # longer than a chunk ends with the first chunk end after it.
        room = got.question_start // S * S - len(texts.needle)  # ends before the question's first chunk
        start, n = got.asked.needle
        if n <= S:
            assert start // S == round(depth * room) // S, (depth, room, got.asked.needle)
        else:
            assert 0 <= start - round(depth * room) < S and (start + n) % S == 0, (depth, room, got.asked.needle)
        # Everything else is the haystack, untouched (the answer's chunk after the answer included).
        mask = needle_positions(L, got)
        assert (out[~mask] == seq[~mask]).all()
        after = got.answer_start + len(texts.answer)
        assert (out[after:] == seq[after:]).all()
        link_before += got.asked.link[0] < got.asked.needle[0]
        link_after += got.asked.link[0] > got.asked.needle[0]
    assert link_before and link_after  # the link comes first in some samples, the key needle in others


@pytest.mark.parametrize("L,S,chains", [(256, 8, 2), (512, 16, 2), (1024, 32, 2), (256, 16, 3), (512, 16, 4)])
def test_inserter_sequences_follow_the_definition(hop_model, sp, L, S, chains):
    ins = one_family_mix(hop_model, L, S, "multihop", chains=chains)
    depths = []
    for seed in range(60):
        seq = filler(sp, L)
        out, answer = insert_task(ins, seq, np.random.default_rng(seed))
        assert (seq == filler(sp, L)).all()
        got = check_two_hop(out, sp.encode, sp.decode, S, answer.start, answer.stop - answer.start, chains=chains)
        assert len(got.distractors) == chains - 1
        assert 10_000 <= int(got.key) < 100_000
        depths.append(got.asked.needle[0] / (got.question_start - got.asked.needle[1]))
    assert min(depths) < 0.25 and max(depths) > 0.75  # random depths, spread over the room


def test_inserter_that_accepts_a_length_never_fails_on_it(hop_model):
    """The dry run in ``__init__`` promises that a training run stops before its first step when ``seq_len`` is
    too short: a length it accepts must hold every later sample."""
    S = 8
    L = next(n for n in range(40, 400) if _accepts(hop_model, n, S))
    for n in (L, L + S):
        ins = one_family_mix(hop_model, n, S, "multihop")
        failing = []
        for seed in range(400):
            try:
                insert_task(ins, np.zeros(n, dtype=np.int64), np.random.default_rng([9, 2, seed]))
            except ValueError:
                failing.append(seed)
        assert not failing, f"seq_len={n}, chunk_size={S}: accepted, yet {len(failing)}/400 samples fail"


def _accepts(model: Path, L: int, S: int) -> bool:
    try:
        one_family_mix(model, L, S, "multihop")
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- 4: errors


def test_too_short_names_the_settings(hop_model):
    with pytest.raises(ValueError, match=r"train\.seq_len=96 is too short for the retrieval family multihop"):
        one_family_mix(hop_model, 96, 16, "multihop")
    one_family_mix(hop_model, 192, 16, "multihop")
    with pytest.raises(ValueError, match=r"seq_len=192 is too short for the retrieval family multihop .*chains=5"):
        one_family_mix(hop_model, 192, 16, "multihop", chains=5)
    one_family_mix(hop_model, 96, 16, "single")  # the one-needle mix fits


def test_unknown_variant(hop_model):
    with pytest.raises(ValueError, match=r"data\.retrieval_mix\.families: unknown \['bogus'\]"):
        one_family_mix(hop_model, 1024, 16, "bogus")


@pytest.mark.parametrize("S", [8, 16, 33])
def test_question_tail_longer_than_a_chunk_plus_one(S):
    head_start, tail_start, answer_start = place_hop_question(40 * S, S, 5, S + 1, 5)  # the longest that fits
    assert tail_start == answer_start - S - 1 and head_start + 5 == tail_start  # head ends where the tail starts
    with pytest.raises(ValueError, match=rf"take {S + 2} tokens; with chunk_size={S} at most {S + 1} fit"):
        place_hop_question(40 * S, S, 5, S + 2, 5)


def test_question_template_too_long_after_the_name(sp):
    templates = {**HOP_TEMPLATES, "question": " Where does {name} lead? " + "Tell me the pass key there. " * 3}
    rng = np.random.default_rng(0)
    texts = hop_texts(sp.encode, sp.decode, templates, "12345", lambda: "54321", rng)
    assert len(texts.tail) > 17
    with pytest.raises(ValueError, match="with chunk_size=16 at most 17 fit"):
        lay_out_multihop(np.zeros(4096, dtype=np.int64), texts, 16, 0.5, rng)


@pytest.mark.parametrize(
    "question, error",
    [
        (" What is the pass key?", "lacks {name}"),
        (" Where is {{name}} now? The key is", "lacks {name}"),  # an escaped brace is no placeholder
        (" The pass key of {name}", "needs words after {name}"),
        (" The pass key of {name}  \n", "needs words after {name}"),
    ],
)
def test_split_question_refuses(question, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        split_question(question)


def test_split_question_cuts_after_the_first_name():
    assert split_question(HOP_TEMPLATES["question"]) == (" Where does {name}", " lead? The pass key there is")
    assert split_question(" Is {name:>6} it?") == (" Is {name:>6}", " it?")


def test_config_rejects_an_unknown_variant():
    base = ["run_dir=/tmp/unused/run", "data.path=/tmp/unused/data"]
    with pytest.raises(ConfigError, match=r"data\.needle_variant must be one of \['single', .*\]; got 'bogus'"):
        load_config(None, [*base, "data.needle_variant=bogus"])
    assert load_config(None, [*base, "data.needle_variant=multihop"]).data.needle_variant == "multihop"
    with pytest.raises(ConfigError, match=r"data\.hop_chains must be >= 2 .*; got 1"):
        load_config(None, [*base, "data.needle_mix=0.5", "data.hop_chains=1"])
    with pytest.raises(ConfigError, match=r"data\.hop_chains applies only with data\.needle_mix > 0"):
        load_config(None, [*base, "data.hop_chains=3"])


def test_too_short_for_the_variant_stops_before_training(tmp_path, tiny_data, overrides):
    extra = {"data.needle_mix": 0.5, "data.needle_variant": "multihop", "model.chunk_size": 16}
    cfg = load_config(None, overrides(tmp_path / "short", tiny_data, **extra, **{"train.seq_len": 96}))
    with pytest.raises(ConfigError, match=r"train\.seq_len=96 is too short for the retrieval family multihop"):
        check_inputs(cfg)
    check_inputs(load_config(None, overrides(tmp_path / "long", tiny_data, **extra, **{"train.seq_len": 512})))
    many = {**extra, "train.seq_len": 512, "data.hop_chains": 20}  # 40 needles in 32 chunks
    with pytest.raises(ConfigError, match=r"seq_len=512 is too short for the retrieval family multihop .*chains=20"):
        check_inputs(load_config(None, overrides(tmp_path / "many", tiny_data, **many)))


# ---------------------------------------------------------------- 5: the loader's answer weights


def test_rank_batches_weigh_exactly_the_two_hop_answers(tiny_data, hop_model, sp):
    L, S, batch = 256, 16, 8
    reader = MDSReader(str(tiny_data), "train", cache_dir=None)
    needles = one_family_mix(hop_model, L, S, "multihop", fraction=0.5)

    def loader(with_needles: bool) -> RankBatches:
        stream = PackedSequences(reader, seq_len=L, seed=0, shuffle=True, window=8, eos_id=None)
        if not with_needles:
            return RankBatches(stream, global_batch=batch, micro_batch=4, rank=0, world_size=1)
        return RankBatches(
            with_tasks(stream, needles.fraction),
            global_batch=batch,
            micro_batch=4,
            rank=0,
            world_size=1,
            mix=needles,
            seed=9,
            answer_weight=5.0,
        )

    marked = 0
    plain_loader, mixed_loader = loader(False), loader(True)
    for _ in range(2):
        plain = torch.cat(plain_loader.next_step()).numpy()
        pairs = mixed_loader.next_step_weighted()
        tokens = torch.cat([t for t, _ in pairs]).numpy()
        weights = torch.cat([w for _, w in pairs if w is not None]).numpy()
        assert weights.shape == tokens.shape and weights.dtype == np.float32
        for row in range(batch):
            heavy = np.flatnonzero(weights[row] != 1.0)
            if not len(heavy):
                assert (tokens[row] == plain[row]).all()  # no needle: the sequence as packed
                continue
            marked += 1
            assert (weights[row, heavy] == 5.0).all()
            # The answer span from the definition alone: after the first token of the last chunk that fits it.
            answer_len = len(heavy)
            answer_start = max(a for a in range(1, L, S) if a + answer_len <= L)
            assert heavy.tolist() == list(range(answer_start, answer_start + answer_len))
            got = check_two_hop(tokens[row], sp.encode, sp.decode, S, answer_start, answer_len, chains=2)
            assert sp.decode(tokens[row, heavy].tolist()) == got.key  # the weights cover the key, all of it
    assert 0 < marked < 2 * batch


def test_the_asked_needle_ends_its_chunk_no_more_often_than_the_distractors(sp):
    """A layout cue that tells the asked chain from the distractor lets a retriever skip the hop: the asked key
    needle once ended its chunk in ~85% of samples against ~40% for the distractor's, and both models learned to
    pick the needle that ends its chunk. Over many samples the two rates must be alike."""
    S, L, n = 16, 1024, 600
    ends = {"asked": 0, "distractor": 0}
    for seed in range(n):
        rng = np.random.default_rng([3, seed])
        key = str(int(rng.integers(10_000, 100_000)))
        texts = hop_texts(
            sp.encode, sp.decode, HOP_TEMPLATES, key, lambda rng=rng: str(int(rng.integers(10_000, 100_000))), rng
        )
        _, where = lay_out_multihop(np.zeros(L, dtype=np.int64), texts, S, float(rng.random()), rng)
        ends["asked"] += (where.needle_start + len(texts.needle)) % S == 0
        ends["distractor"] += (where.others[2] + len(texts.distractors[1])) % S == 0
    assert abs(ends["asked"] - ends["distractor"]) < 0.1 * n, ends

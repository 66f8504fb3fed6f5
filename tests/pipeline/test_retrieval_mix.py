"""The retrieval task families and the pretraining mix (``pipeline.data.retrieval_tasks``, ``pipeline.data.mix``).

Each family's sample is checked by decoding its text and reading it back with regular expressions written here:
the asked answer is stated exactly once, distractors differ from it, the chunk layout is the one specified; the
trainer's mix and the eval build the same sample from the same seed; the mix meets its fraction and family
weights within sampling error; a resumed stream mixes the same sequences.
"""

from __future__ import annotations

import math
import re
import shutil
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import train_test_tokenizer

from model.retrieval import NEEDLE_CHUNK, NEEDLE_EACH, NEEDLE_QUERY
from pipeline.data.mix import RetrievalMix, sentencepiece_codec
from pipeline.data.mixture import with_tasks
from pipeline.data.needle import SYLLABLES, TEMPLATES, NeedleSpec, lay_out_needle, needle_parts
from pipeline.data.reader import MDSReader, PackedSequences, RankBatches, mark_needles
from pipeline.data.retrieval_tasks import DEFAULT_SHAPE, FAMILIES, FIXED_TEMPLATES, Codec, TaskShape, build_task
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import build_sample
from pipeline.evaluation.tokenizer import ModelTokenizer
from pipeline.train import dist
from pipeline.train.config import DEFAULT_MIX_FAMILIES, ConfigError, load_config, mix_settings
from pipeline.train.inputs import check_inputs
from pipeline.train.trainer import Trainer

FILLER = "the quick brown fox jumps over the lazy dog while a slow grey cat sleeps on the warm mat".split()
NAME = r"([A-Z][a-z]+)"
KEY = r"(\d+)"
NEEDLE_RX = {
    "single": re.compile(r"The pass key is (\d+)\."),
    "multikey": re.compile(rf"One of the special magic numbers for {NAME} is {KEY}\."),
    "multivalue": re.compile(rf"{NAME} has number {KEY}\."),
    "multiquery": re.compile(rf"{NAME} has number {KEY}\."),
    "vt": re.compile(rf"{NAME} = (\d+|[A-Z][a-z]+)\."),
}
QUESTION_RX = {
    "single": re.compile(r"What is the pass key\? The pass key is$"),
    "multikey": re.compile(rf"What is the special magic number for {NAME}\? The special magic number for \1 is$"),
    "multivalue": re.compile(rf"What numbers does {NAME} have\? They are$"),
    "multiquery": re.compile(r"What numbers do (.+) have\? They are$"),
    "vt": re.compile(r"Which names equal (\d+)\? They are$"),
}
APART = ("multikey", "multivalue", "multiquery", "vt")
"""Families whose needles each sit in chunks of their own."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(0)
    lines = [" ".join(FILLER)] * 20
    for _ in range(300):
        name = "".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4)))).capitalize()
        key = str(rng.integers(10_000, 100_000))
        values = {"name": name, "key": key, "names": f"{name}, {name} and {name}", "previous": name, "next": name}
        lines += [t.format(**values) for family in FIXED_TEMPLATES.values() for t in family.values()]
        lines += [t.format(**values) for family in TEMPLATES.values() for t in family.values() if t]
        lines += [f" {key}, {key}, {key}", f" {name}, {name}"]
    path = tmp_path_factory.mktemp("mix_tok") / "tokenizer.model"
    path.write_bytes(train_test_tokenizer(lines, 400, character_coverage=1.0, byte_fallback=False))
    return path


@pytest.fixture(scope="module")
def codec(tokenizer):
    return sentencepiece_codec(tokenizer)


def haystack(codec, n: int, seed: int) -> np.ndarray:
    """``n`` tokens of lower-case words (no digits, no capitals: nothing a needle regex could match)."""
    rng = np.random.default_rng(seed)
    ids = codec.encode(" ".join(rng.choice(FILLER, size=n)))
    return np.asarray(ids[:n], dtype=np.int64)


def check_sample(sample, codec, family: str, S: int, shape: TaskShape, hay: np.ndarray) -> None:
    """The sample read back from its decoded text, against the family's definition."""
    ids = sample.ids
    assert ids.shape == hay.shape
    assert (sample.answer_start - 1) % S == 0  # the question's last token opens the answer's chunk
    assert (ids[sample.answer_start + sample.answer_len :] == hay[sample.answer_start + sample.answer_len :]).all()
    answer_text = codec.decode(ids[sample.answer].tolist()).strip()
    assert codec.decode(ids[sample.answer][:1].tolist()).strip(), "the first answer token is not whitespace"
    before = codec.decode(ids[: sample.answer_start].tolist())
    question = QUESTION_RX[family].search(before)
    assert question, before[-120:]
    haystack_text = before[: question.start()]
    found = NEEDLE_RX[family].findall(haystack_text)
    # No needle that fits in a chunk straddles two: each is found inside a single chunk's text (a longer one
    # necessarily spans chunks; the tokens of a sentence decoded alone may differ slightly, hence the margin).
    if max(len(codec.encode(m.group(0))) for m in NEEDLE_RX[family].finditer(haystack_text)) <= S - 2:
        per_chunk = [
            NEEDLE_RX[family].findall(codec.decode(ids[k * S : (k + 1) * S].tolist())) for k in range(len(ids) // S)
        ]
        assert sum(len(n) for n in per_chunk) == len(found)
        if family in APART:
            assert max(len(n) for n in per_chunk) == 1  # one needle per chunk at most
    if family == "single":
        assert found == [answer_text]
    elif family == "multikey":
        asked = question.group(1)
        assert len(found) == shape.needles and len({n for n, _ in found}) == shape.needles
        assert [k for n, k in found if n == asked] == [answer_text]
        assert answer_text not in {k for n, k in found if n != asked}
    elif family == "multivalue":
        asked = question.group(1)
        assert {n for n, _ in found} == {asked} and len(found) == shape.values
        keys = [k for _, k in found]
        assert len(set(keys)) == len(keys) and answer_text == ", ".join(keys)  # all of them, in text order
    elif family == "multiquery":
        names = re.split(r", | and ", question.group(1))
        assert len(names) == shape.queries and len(found) == shape.needles
        value = dict(found)
        assert len(value) == shape.needles  # distinct names
        assert answer_text == ", ".join(value[n] for n in names)
        assert not set(answer_text.split(", ")) & {k for n, k in found if n not in names}
    elif family == "vt":
        check_chains(found, question.group(1), answer_text, shape)
    for answer in sample.answers:  # each asked answer is stated exactly once before the question (vt: assigned)
        stated = [lhs for lhs, _ in found] if family == "vt" else re.findall(rf"\b{answer}\b", haystack_text)
        assert stated.count(answer) == 1


def check_chains(statements: list[tuple[str, str]], value: str, answer: str, shape: TaskShape) -> None:
    """Variable tracking read from the text: every name is assigned once, each copy after its source; the answer
    lists the names holding ``value``, in chain order."""
    assert len(statements) == shape.chains * (shape.hops + 1)
    holds: dict[str, str] = {}
    order = []
    for lhs, rhs in statements:
        assert lhs not in holds  # assigned once
        if rhs.isdigit():
            holds[lhs] = rhs
        else:
            assert rhs in holds, f"{lhs} = {rhs} comes before {rhs} is assigned"
            holds[lhs] = holds[rhs]
        order.append(lhs)
    assert Counter(holds.values()) == Counter({v: shape.hops + 1 for v in set(holds.values())})
    assert answer == ", ".join(n for n in order if holds[n] == value)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "multihop"])  # multihop: test_needle_multihop
@pytest.mark.parametrize("L,S", [(512, 16), (1024, 32), (2048, 64)])
def test_every_sample_reads_back_as_its_family_defines(family, L, S, codec):
    shape = TaskShape()
    for seed in range(25):
        hay = haystack(codec, L, seed)
        depth = None if seed % 2 else seed / 25
        sample = build_task(family, hay, codec, np.random.default_rng(seed), chunk_size=S, shape=shape, depth=depth)
        check_sample(sample, codec, family, S, shape, hay)


@pytest.mark.parametrize(
    "family,shape",
    [
        ("multikey", TaskShape(needles=7)),
        ("multivalue", TaskShape(values=5)),
        ("multiquery", TaskShape(needles=6, queries=3)),
        ("vt", TaskShape(chains=3, hops=3)),
        ("vt", TaskShape(chains=1, hops=1)),
    ],
)
def test_the_shape_sets_the_counts(family, shape, codec):
    for seed in range(10):
        hay = haystack(codec, 2048, seed)
        sample = build_task(family, hay, codec, np.random.default_rng(seed), chunk_size=32, shape=shape)
        check_sample(sample, codec, family, 32, shape, hay)


@pytest.mark.parametrize("family", ["single", "multivalue", "multiquery"])
def test_depth_places_the_first_asked_needle(family, codec):
    S, L = 16, 1024
    for depth in (0.0, 0.5, 1.0):
        sample = build_task(family, haystack(codec, L, 0), codec, np.random.default_rng(1), chunk_size=S, depth=depth)
        assert abs(sample.needle_start - depth * sample.room) < S
        assert sample.needle_start // S in sample.asked_chunks


def test_too_short_and_unknown_are_refused(codec):
    with pytest.raises(ValueError, match="too few free chunks"):
        build_task("multivalue", haystack(codec, 64, 0), codec, np.random.default_rng(0), chunk_size=16)
    with pytest.raises(ValueError, match="fewer than the 9 variable-tracking statements"):
        build_task(
            "vt", haystack(codec, 128, 0), codec, np.random.default_rng(0), chunk_size=16, shape=TaskShape(chains=3)
        )
    with pytest.raises(ValueError, match=r"retrieval task family 'bogus' is not one of"):
        build_task("bogus", haystack(codec, 512, 0), codec, np.random.default_rng(0), chunk_size=16)


# ---------------------------------------------------------------- the trainer's mix and the eval agree


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_and_eval_build_the_same_sample_from_the_same_seed(family, tokenizer, codec):
    L, S = 1024, 16
    mix = RetrievalMix(codec, seq_len=L, chunk_size=S, fraction=1.0, families={family: 1.0})
    tok = ModelTokenizer(tokenizer)
    source = TokenSource("builtin", tok, seed=0)
    for seed in range(5):
        depth = seed / 4
        spec = NeedleSpec(variant=family)
        evaluated = build_sample(
            source, tok, spec, length=L, depth=depth, rng=np.random.default_rng(seed), chunk_size=S
        )
        rng = np.random.default_rng(seed)
        window = source.window(L, rng).astype(np.int64)  # the eval's haystack, drawn as the eval draws it
        trained = mix.insert(window, rng, family, depth=depth)
        assert (trained.ids == evaluated.ids).all() and trained.answer == evaluated.answer
        assert trained.answers == evaluated.answers


def test_a_one_family_mix_makes_the_draws_of_the_older_needle_mix(codec):
    """``data.needle_mix`` became a one-family mix: a sequence that carries a task gets the needle it got before,
    whose draw order (the skipped selection draw, key, depth) is rebuilt here from the layout functions."""
    L, S, seed = 256, 16, 9
    mix = RetrievalMix(codec, seq_len=L, chunk_size=S, fraction=0.5, families={"single": 1.0})
    for gid in range(40):
        seq = haystack(codec, L, gid)
        got = mix.task_for(seq, np.random.default_rng([seed, 2, gid]))
        rng = np.random.default_rng([seed, 2, gid])
        rng.random()  # the draw that selected the sequence when the mix was a random share
        key = str(int(rng.integers(10_000, 100_000)))
        needle, question, answer = needle_parts(NeedleSpec(), codec.encode, codec.decode, key)
        expected, _ = lay_out_needle(seq, needle, question, answer, depth=rng.random(), chunk_size=S)
        assert (got.ids == expected).all()


def test_the_mix_draws_its_families_by_weight_within_sampling_error(codec):
    """Which sequences carry a task is the mixture schedule's (tests/pipeline/test_mixture.py); which family each
    gets is drawn by the family weights."""
    L, S, n = 512, 16, 1500
    weights = {"single": 1.0, "multivalue": 2.0, "vt": 1.0}
    mix = RetrievalMix(codec, seq_len=L, chunk_size=S, fraction=0.2, families=weights)
    seq = haystack(codec, L, 0)
    families = Counter(mix.task_for(seq, np.random.default_rng([3, 2, gid])).family for gid in range(n))
    for family, weight in weights.items():
        p = weight / sum(weights.values())
        assert abs(families[family] - p * n) < 4 * math.sqrt(n * p * (1 - p)), (family, families)


def test_bad_mix_settings_are_refused_naming_them(codec):
    kwargs = {"seq_len": 512, "chunk_size": 16, "fraction": 0.1}
    with pytest.raises(ValueError, match=r"data\.retrieval_mix\.families: unknown \['nope'\]"):
        RetrievalMix(codec, families={"nope": 1.0}, **kwargs)
    with pytest.raises(ValueError, match="gives no family a weight above 0"):
        RetrievalMix(codec, families={"single": 0.0}, **kwargs)
    with pytest.raises(ValueError, match=r"train\.seq_len=96 is too short for the retrieval family vt .*chains=2"):
        RetrievalMix(codec, families={"vt": 1.0}, **{**kwargs, "seq_len": 96})
    with pytest.raises(ValueError, match="queries=5 cannot exceed needles=4"):
        RetrievalMix(codec, families={"multiquery": 1.0}, shape=TaskShape(queries=5), **kwargs)


def test_a_resumed_stream_mixes_the_same_sequences(tiny_data, codec):
    """The mixed sequences depend on the sequence, not on how far this process read: a stream restored from a
    mid-epoch state gives the steps that the uninterrupted stream gives."""
    L, S = 512, 16
    reader = MDSReader(str(tiny_data), "train", cache_dir=None)
    mix = RetrievalMix(codec, seq_len=L, chunk_size=S, fraction=0.5, families={"single": 1.0, "multiquery": 1.0})

    def batches() -> RankBatches:
        stream = with_tasks(PackedSequences(reader, seq_len=L, seed=0, shuffle=True, window=4, eos_id=None), 0.5)
        return RankBatches(stream, global_batch=4, micro_batch=2, rank=0, world_size=1, mix=mix, seed=5)

    first = batches()
    for _ in range(3):
        first.next_step()
    state = first.state_dict()
    assert state["retrieval_mix"] == mix.describe()
    expected = [torch.cat(first.next_step()) for _ in range(3)]
    resumed = batches()
    resumed.load_state_dict(state)
    assert all(torch.equal(torch.cat(resumed.next_step()), e) for e in expected)
    assert sum(first.families.values()) > 0


# ---------------------------------------------------------------- the config keys and the trainer


def test_the_mix_keys_and_their_older_spelling(tmp_path):
    base = [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}"]
    default = mix_settings(load_config(None, [*base, "data.retrieval_mix.fraction=0.05"]).data)
    assert default.fraction == 0.05 and default.families == DEFAULT_MIX_FAMILIES  # the five, equal weights
    chosen = load_config(None, [*base, "data.retrieval_mix.fraction=0.1", "data.retrieval_mix.families={vt: 2}"])
    assert mix_settings(chosen.data).families == {"vt": 2.0}  # the families named replace the default set
    older = mix_settings(
        load_config(None, [*base, "data.needle_mix=0.3", "data.needle_variant=multihop", "data.hop_chains=3"]).data
    )
    assert (older.fraction, older.families, older.shape.chains) == (0.3, {"multihop": 1.0}, 3)
    refused = [
        (["data.needle_mix=0.3", "data.retrieval_mix.fraction=0.1"], "two spellings of one mix"),
        (["data.retrieval_mix.fraction=1.5"], r"data\.retrieval_mix\.fraction must be in \[0, 1\]; got 1\.5"),
        (["data.retrieval_mix.families={passkey: 1}"], r"families: unknown \['passkey'\]"),
        (["data.retrieval_mix.families={vt: -1}"], r"families\.vt must be a finite weight >= 0; got -1"),
        (["data.retrieval_mix.families={vt: 0}"], "gives no family a weight above 0"),
        (["data.retrieval_mix.queries=9"], "data.retrieval_mix.queries=9 cannot exceed needles=4"),
        (["data.needle_answer_weight=5"], r"data\.needle_answer_weight applies only with data\.needle_mix > 0"),
        (["data.retrieval_mix.answer_weight=0"], r"data\.retrieval_mix\.answer_weight must be > 0; got 0"),
        (["data.retrieval_mix.value_kind=hex"], r"data\.retrieval_mix\.value_kind='hex' is not one of"),
    ]
    for extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, *extra])


def test_uuid_values_in_the_mix_read_back_as_rulers_niah_single_3(tmp_path):
    """``data.retrieval_mix.value_kind=uuid`` with one multikey needle: the sample RULER's niah_single_3 asks about,
    read back from its text with a character-level codec (every UUID character survives the round trip)."""
    chars = Codec(encode=lambda text: [ord(ch) for ch in text], decode=lambda ids: "".join(map(chr, ids)))
    base = [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.retrieval_mix.fraction=1"]
    keys = ["data.retrieval_mix.families={multikey: 1}", "data.retrieval_mix.needles=1", "data.retrieval_mix.queries=1"]
    settings = mix_settings(load_config(None, [*base, *keys, "data.retrieval_mix.value_kind=uuid"]).data)
    mix = RetrievalMix(
        chars, seq_len=1024, chunk_size=16, fraction=1.0, families=settings.families, shape=settings.shape
    )
    rng = np.random.default_rng(0)
    hay = np.asarray(chars.encode(" ".join(rng.choice(FILLER, size=300)))[:1024], dtype=np.int64)
    uuid_rx = r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
    keys_seen = set()
    for seed in range(4):
        sample = mix.insert(hay, np.random.default_rng(seed), "multikey")
        before = chars.decode(sample.ids[: sample.answer_start].tolist())
        needles = re.findall(rf"One of the special magic uuids for {NAME} is {uuid_rx}\.", before)
        assert len(needles) == 1 and needles[0][1] == sample.key and uuid.UUID(sample.key).version == 4
        name = needles[0][0]
        assert before.rstrip().endswith(
            f"What is the special magic uuid for {name}? The special magic uuid for {name} is"
        )
        assert chars.decode(sample.ids[sample.answer].tolist()).strip() == sample.key
        keys_seen.add(sample.key)
    assert len(keys_seen) == 4
    numbers = mix_settings(load_config(None, [*base, *keys]).data)
    assert numbers.shape.value_kind == "number"  # the default: 5-digit values, as before


def test_a_variant_draws_its_own_shape_beside_its_familys(tmp_path, codec):
    """``data.retrieval_mix.variants``: one-needle UUID multikey samples (RULER's niah_single_3) beside the section's
    4-needle number multikey samples, each drawn by its weight; a mix without variants describes itself as before,
    so older checkpoints resume against the same settings."""
    base = [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.retrieval_mix.fraction=1"]
    keys = [
        "data.retrieval_mix.families={multikey: 1, uuid_single: 1}",
        "data.retrieval_mix.variants={uuid_single: {family: multikey, needles: 1, queries: 1, value_kind: uuid}}",
    ]
    settings = mix_settings(load_config(None, [*base, *keys]).data)
    L, S, n = 512, 16, 200
    mix = RetrievalMix(
        codec,
        seq_len=L,
        chunk_size=S,
        fraction=1.0,
        families=settings.families,
        shape=settings.shape,
        variants=settings.variants,
    )
    seq = haystack(codec, L, 0)
    kinds = Counter()
    for gid in range(n):
        sample = mix.task_for(seq, np.random.default_rng([5, 2, gid]))
        assert sample.family == "multikey"
        is_uuid = re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", sample.key) is not None
        text = codec.decode(sample.ids[: sample.answer_start].tolist())
        # the variant: one needle, a UUID; the family's own shape: four needles, 5-digit numbers
        assert text.count("One of the special magic") == (1 if is_uuid else 4)
        assert is_uuid or re.fullmatch(r"\d{5}", sample.key)
        kinds[is_uuid] += 1
    assert abs(kinds[True] - n / 2) < 4 * math.sqrt(n / 4), kinds
    described = mix.describe()
    assert described["families"] == {"multikey": 0.5, "uuid_single": 0.5}
    assert described["variants"]["uuid_single"]["shape"]["value_kind"] == "uuid"
    plain = RetrievalMix(codec, seq_len=L, chunk_size=S, fraction=1.0, families={"multikey": 1.0})
    assert set(plain.describe()) == {"fraction", "families", "shape"}
    with pytest.raises(ValueError, match=r"too short for the retrieval variant uuid_single .*value_kind=uuid"):
        RetrievalMix(
            codec,
            seq_len=96,
            chunk_size=S,
            fraction=1.0,
            families={"uuid_single": 1.0},
            variants=settings.variants,
        )


@pytest.mark.parametrize(
    "variants,families,error",
    [
        ("{single: {family: multikey}}", "{single: 1}", "variants.single: a variant cannot take a family's name"),
        ("{u: {family: multi}}", "{u: 1}", "variants.u.family must be one of"),
        ("{u: {family: multikey, needle: 1}}", "{u: 1}", "variants.u: ['needle'] are not shape keys"),
        ("{u: {family: multikey, needles: 0}}", "{u: 1}", "variants.u: needles=0 must be >= 1"),
        ("{u: {family: multikey, value_kind: hex}}", "{u: 1}", "variants.u: value_kind='hex' is not one of"),
        ("{u: {family: multikey}}", "{single: 1}", "variants: ['u'] have no weight in data.retrieval_mix.families"),
        ("{}", "{u: 1}", "families: unknown ['u']"),
    ],
)
def test_bad_variants_are_one_line_naming_the_key(tmp_path, variants, families, error):
    keys = [f"data.retrieval_mix.variants={variants}", f"data.retrieval_mix.families={families}"]
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.retrieval_mix.fraction=1", *keys],
        )
    assert error in str(err.value) and "\n" not in str(err.value)


def test_the_trainer_writes_the_mix_into_its_sequences_and_weighs_the_answers(
    tmp_path, tiny_data, tokenizer, overrides
):
    data = tmp_path / "data"  # tiny_data's shards with a tokenizer that can spell the needles
    shutil.copytree(tiny_data, data)
    shutil.copyfile(tokenizer, data / "tokenizer.model")
    extra = {
        "model.vocab_size": 512,
        "train.seq_len": 1024,
        "model.chunk_size": 16,
        "data.retrieval_mix.fraction": 0.5,
        "data.retrieval_mix.families": "{single: 1, multiquery: 1, vt: 1}",
        "data.retrieval_mix.answer_weight": 3.0,
    }
    trainer = Trainer(load_config(None, overrides(tmp_path / "run", data, **extra)), dist.init_distributed("none"))
    pairs = [pair for _ in range(4) for pair in trainer.batches.next_step_weighted()]
    tokens = torch.cat([t for t, _ in pairs]).numpy()
    weights = torch.cat([w for _, w in pairs]).numpy()
    decode = sentencepiece_codec(tokenizer).decode
    questions = {"single": QUESTION_RX["single"], "multiquery": QUESTION_RX["multiquery"], "vt": QUESTION_RX["vt"]}
    seen = Counter()
    for row, w in zip(tokens, weights):
        heavy = np.flatnonzero(w == 3.0)
        if not len(heavy):
            continue
        assert (np.diff(heavy) == 1).all()  # one contiguous answer
        before = decode(row[: heavy[0]].tolist())
        family = next(f for f, rx in questions.items() if rx.search(before))
        seen[family] += 1
    assert sum(seen.values()) == sum(trainer.batches.families.values()) > 0
    assert set(seen) <= set(questions) and seen == trainer.batches.families
    with pytest.raises(ConfigError, match=r"train\.seq_len=96 is too short for the retrieval family (multiquery|vt)"):
        check_inputs(load_config(None, overrides(tmp_path / "short", data, **{**extra, "train.seq_len": 96})))


def test_the_paper_scale_config_mixes_every_default_family(codec):
    cfg = load_config(str(Path(__file__).parents[2] / "configs/train/gca_pg19_16k.yaml"), [], 8)
    settings = mix_settings(cfg.data)
    assert settings.fraction == 0.05 and settings.families == DEFAULT_MIX_FAMILIES
    # Its 16,380-token sequences of 63-token chunks hold a sample of every family (the dry run builds 64 each).
    RetrievalMix(
        codec, seq_len=cfg.train.seq_len, chunk_size=cfg.model.chunk_size, fraction=0.05, families=settings.families
    )


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_a_needle_longer_than_a_chunk_ends_with_a_chunk(depth, codec):
    """Every multikey needle (longer than the chunk here), asked or not, ends where a chunk ends, so its last
    chunk holds the key and the end of the name before it; the asked one stays within a chunk of its depth."""
    S = 8
    for seed in range(6):
        hay = haystack(codec, 640, seed)
        sample = build_task("multikey", hay, codec, np.random.default_rng(seed), chunk_size=S, depth=depth)
        text = codec.decode(sample.ids[: sample.answer_start].tolist())
        needles = [m.group(0) for m in NEEDLE_RX["multikey"].finditer(text)]
        assert len(needles) == DEFAULT_SHAPE.needles
        ends = []
        for needle in needles:
            ids = codec.encode(" " + needle + " ")
            assert len(ids) > S
            at = [i for i in range(len(sample.ids) - len(ids)) if (sample.ids[i : i + len(ids)] == ids).all()]
            assert len(at) == 1, needle
            ends.append(at[0] + len(ids))
            last = codec.decode(sample.ids[ends[-1] - S : ends[-1]].tolist())
            name, key = NEEDLE_RX["multikey"].search(needle).groups()
            assert key in last and name[-3:] in last, (last, needle)  # the key with (the end of) its name
        assert all(end % S == 0 for end in ends), ends
        assert sample.needle_start + sample.needle_len in ends
        assert 0 <= sample.needle_start - round(depth * sample.room) < S


# ---------------------------------------------------------------- the retriever's supervised loss


def test_the_retriever_loss_labels_each_tasks_question_landmark_and_needle_chunks(
    tmp_path, tiny_data, tokenizer, overrides
):
    """``data.retrieval_mix.retriever_loss``: every task sequence's label marks the landmark the eval reads the
    question's retrieval from (``TaskSample.question_row``) and the chunks holding the asked key, decoded back from
    the sequence; sequences without a task are unlabelled."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shutil.copyfile(tokenizer, data / "tokenizer.model")
    S = 16
    extra = {
        "model.vocab_size": 512,
        "train.seq_len": 512,
        "model.chunk_size": S,
        "data.retrieval_mix.fraction": 0.5,
        "data.retrieval_mix.families": "{single: 1}",
        "data.retrieval_mix.retriever_loss": 2.0,
    }
    trainer = Trainer(load_config(None, overrides(tmp_path / "run", data, **extra)), dist.init_distributed("none"))
    assert trainer.retriever_loss == 2.0
    decode = sentencepiece_codec(tokenizer).decode
    labelled = 0
    for _ in range(3):
        tokens = torch.cat(trainer.batches.next_step()).numpy()
        labels = torch.cat(trainer.batches.retrieval_labels).numpy()
        assert labels.shape == (len(tokens), 512 // S)
        for row, marks in zip(tokens, labels):
            query = np.flatnonzero(marks == NEEDLE_QUERY)
            text = decode(row.tolist())
            if not len(query):
                assert not marks.any() and "What is the pass key?" not in text
                continue
            labelled += 1
            (question_landmark,) = query
            reader_start = (question_landmark + 1) * S  # the chunk that reads the row opens with the question's end
            assert QUESTION_RX["single"].search(decode(row[: reader_start + 1].tolist()).rstrip())
            needle_text = decode(row[np.repeat(marks == NEEDLE_CHUNK, S)].tolist())
            answer = re.match(r"\s*(\d+)", decode(row[reader_start + 1 :].tolist()))
            needle = NEEDLE_RX["single"].search(needle_text)
            assert answer and needle and needle.group(1) == answer.group(1)  # the marked chunks hold the asked key
    assert labelled == sum(trainer.batches.families.values()) > 0


@pytest.mark.parametrize("family", ["multivalue", "multiquery"])
def test_an_answer_longer_than_a_chunk_marks_every_row_that_reads_it(family, codec):
    """Answer token ``i`` is predicted at position ``answer_start + i - 1``, whose chunk reads the row of the
    landmark before it: the label marks exactly those rows (several for four 5-digit values on 8-token chunks),
    and the asked values' chunks, whose tokens hold each asked value."""
    S, L = 8, 512
    shape = TaskShape(values=4, needles=4, queries=4)
    mix = RetrievalMix(codec, seq_len=L, chunk_size=S, fraction=1.0, families={family: 1.0}, shape=shape)
    for seed in range(10):
        sample = mix.insert(haystack(codec, L, seed), np.random.default_rng(seed), family)
        marks = np.zeros(L // S, dtype=np.int64)
        mark_needles(marks, sample, S)
        readers = {(sample.answer_start + i - 1) // S - 1 for i in range(sample.answer_len)}
        assert len(readers) >= 2
        assert set(np.flatnonzero(marks == NEEDLE_QUERY)) == readers
        held = codec.decode(sample.ids[np.repeat(marks == NEEDLE_CHUNK, S)].tolist())
        assert all(value in held for value in sample.answers)
        each = np.zeros_like(marks)
        mark_needles(each, sample, S, each=True)  # the same chunks, each a target of its own
        assert np.array_equal(each == NEEDLE_EACH, marks == NEEDLE_CHUNK) and not (each == NEEDLE_CHUNK).any()
        assert np.array_equal(each == NEEDLE_QUERY, marks == NEEDLE_QUERY)


def test_the_retriever_loss_is_refused_where_it_cannot_apply(tmp_path):
    base = [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.retrieval_mix.retriever_loss=1"]
    refused = [
        ([], r"retriever_loss=1\.0 needs retrieval tasks"),
        (["data.retrieval_mix.fraction=0.5", "model.arch=swa"], "needs model.arch=gca"),
        (["data.retrieval_mix.fraction=0.5", "model.retrieval=random"], "supervises a learned retriever"),
        (["data.retrieval_mix.fraction=0.5", "model.retrieval_grad=false"], "trains the retriever"),
        (["data.retrieval_mix.fraction=0.5", "data.retrieval_mix.retriever_loss=-1"], "finite weight >= 0; got -1"),
        (
            [
                "data.retrieval_mix.fraction=0.5",
                "data.retrieval_mix.retriever_loss=0",
                "data.retrieval_mix.retriever_loss_each=true",
            ],
            r"retriever_loss_each=true shapes the retriever's supervised loss, which is off",
        ),
    ]
    for extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, *extra])

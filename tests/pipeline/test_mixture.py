"""Weighted data mixtures (``pipeline/data/mixture.py``, ``pipeline/train/sources.py``): the schedule's shares at
every prefix against exact arithmetic, three real prepared datasets whose tokens tell their source apart, phases
that continue each source where it stopped, exact resume, and the one-line refusals before any work."""

from __future__ import annotations

import logging
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from conftest import EOS, _tokenizer_bytes, prepared_dataset
from helpers import TINY_TRAIN_OVERRIDES, train_test_tokenizer

from data_prep import format as fmt
from pipeline.data import mixture as mixture_module
from pipeline.data.mixture import (
    MixtureResumeError,
    Phase,
    Schedule,
    check_mixture_resume,
    exact_weights,
    interleave,
)
from pipeline.data.order import BlockShuffledSequences
from pipeline.data.reader import MDSReader, RankBatches
from pipeline.train.config import ConfigError, load_config
from pipeline.train.sources import build_stream, check_mixture, resolve_mixture, source_seed

SEQ, BATCH = 64, 6
RANGES = {"books": (2, 22), "code": (22, 42), "web": (42, 64)}
"""Each dataset's token ids lie in its own range, so a sequence's tokens name the source it came from."""
SIZES = {"books": 150, "code": 90, "web": 60}


def _documents(n_docs: int, low: int, high: int, seed: int):
    rng = np.random.default_rng(seed)
    for doc in range(n_docs):
        tokens = rng.integers(low, high, int(rng.integers(30, 160)))
        for piece, part in enumerate(np.array_split(tokens, int(rng.integers(1, 3)))):
            yield doc, piece, part


def _dataset(tmp_path: Path, name: str, n_docs: int, seed: int, tokenizer: bytes, histograms: bool = False) -> Path:
    low, high = RANGES[name]
    train, val = _documents(n_docs, low, high, seed), _documents(5, low, high, seed + 1)
    return prepared_dataset(tmp_path / name, tokenizer, train, val, histograms)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture")
    tokenizer = _tokenizer_bytes()
    return {name: _dataset(root, name, n, i, tokenizer) for i, (name, n) in enumerate(SIZES.items())}


def _spec(datasets: dict[str, Path], weights: dict[str, float], **extra: str) -> str:
    items = [
        f"{{path: {datasets[name]}, weight: {w}, max_repeat: 100{extra.get(name, '')}}}" for name, w in weights.items()
    ]
    return f"data.sources=[{', '.join(items)}]"


def _config(tmp_path: Path, *overrides: str):
    base = {**TINY_TRAIN_OVERRIDES, "run_dir": tmp_path / "run", "train.global_batch": BATCH, "train.micro_batch": 1}
    return load_config(None, [*(f"{k}={v}" for k, v in base.items()), *overrides])


def _source_of(sequence: np.ndarray) -> str:
    text = sequence[sequence != EOS]
    found = {name for name, (low, high) in RANGES.items() if ((text >= low) & (text < high)).all()}
    assert len(found) == 1, sequence
    return found.pop()


# ---------------------------------------------------------------- the schedule


def test_every_prefix_holds_each_weight_within_one_sequence():
    """Against exact arithmetic: |count_d(n) - w_d n| < 1 for every prefix n and source d, for random weights of 2
    to 8 sources (Megatron's largest-shortfall rule exceeds 1 on such weights; the Pfair schedule does not)."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        raw = rng.dirichlet(np.ones(int(rng.integers(2, 9))) * rng.choice([0.3, 1.0, 3.0]))
        weights = exact_weights(raw.tolist())
        assert sum(weights) == 1
        order = interleave(weights, 1500)
        counts = np.zeros(len(weights), dtype=np.int64)
        for n, source in enumerate(order, start=1):
            counts[source] += 1
            for d, w in enumerate(weights):
                assert abs(counts[d] - w * n) < 1, (raw, n, d)


def test_a_tiled_period_equals_the_schedule_built_position_by_position():
    from pipeline.data.mixture import PhaseOrder, earliest_deadline_first

    for raw in ([0.5, 0.3, 0.2], [0.28, 0.28, 0.39, 0.05], [1 / 3, 2 / 3], [1.0], [0.1, 0.0, 0.9], [0.3571, 0.6429]):
        weights = exact_weights(raw)
        reference = earliest_deadline_first(weights, 30000)
        order = PhaseOrder(weights)
        assert (order.slice(0, 30000) == reference).all(), raw
        assert (np.concatenate([order.slice(a, 7) for a in range(0, 29995, 7)]) == reference[:29995]).all()
        assert (order.counts(29999) == np.bincount(reference[:29999], minlength=len(raw))).all()


def test_weights_become_multiples_of_the_resolution_nearest_the_normalised_value():
    for raw in ([0.5, 0.3, 0.2], [801888, 743780, 697193], [1e-9, 1.0], [3.0, 0.0, 1.0], [1.0] * 7):
        weights = exact_weights(raw)
        assert sum(weights) == 1 and all((w * (1 << 16)).denominator == 1 for w in weights)
        for w, r in zip(weights, raw):
            assert (w > 0) == (r > 0) and abs(float(w) - r / sum(raw)) <= 2**-16


def test_a_source_of_weight_zero_is_never_drawn_and_a_schedule_is_the_same_built_in_pieces():
    phases = [Phase(0, exact_weights([0.5, 0.0, 0.5])), Phase(30, exact_weights([0.0, 1.0, 3.0]))]
    schedule = Schedule(phases)
    whole = schedule.range(0, 100)
    assert (np.concatenate([schedule.range(a, 7) for a in range(0, 100, 7)])[:100] == whole).all()
    assert all((schedule.counts(n, 3) == np.bincount(whole[:n], minlength=3)).all() for n in range(101))
    assert 1 not in whole[:30] and 0 not in whole[30:]
    assert (np.bincount(whole[30:], minlength=3) == [0, 17, 53]).all()  # 70 x 1/4 = 17.5, 70 x 3/4 = 52.5


# ---------------------------------------------------------------- three real datasets


def _draws(cfg, batches: int):
    mixture = resolve_mixture(cfg)
    stream, _ = build_stream(cfg, mixture, EOS, cache=str(Path(cfg.run_dir) / "cache"))
    return mixture, stream, [stream.next_labeled(BATCH) for _ in range(batches)]


def test_three_datasets_give_their_shares_at_every_prefix_and_the_same_order_twice(tmp_path, datasets):
    weights = {"books": 0.5, "code": 0.3, "web": 0.2}
    cfg = _config(tmp_path, _spec(datasets, weights))
    mixture, _, draws = _draws(cfg, 20)
    labels = mixture.labels
    counts = dict.fromkeys(labels, 0)
    for n, (sequence, source) in enumerate(
        ((s, d) for draw in draws for s, d in zip(draw.sequences, draw.sources)), start=1
    ):
        assert _source_of(sequence) == labels[source]  # the tokens come from the dataset the schedule names
        counts[labels[source]] += 1
        for label, w in weights.items():
            assert abs(counts[label] - w * n) < 1, (n, counts)
    _, _, again = _draws(cfg, 20)
    first = b"".join(d.sequences.tobytes() for d in draws)
    assert first == b"".join(d.sequences.tobytes() for d in again)


def test_each_source_reads_its_own_stream_in_order_across_a_phase_change(tmp_path, datasets):
    """A new phase continues every source where it stopped: the sequences a source gave, in order, are its own
    stream's first ones (no document repeated or skipped), and the shares after the change follow the new weights."""
    phases = "data.phases=[{start_step: 5, weights: {books: 0.1, code: 0.1, web: 0.8}}]"
    cfg = _config(tmp_path, _spec(datasets, {"books": 0.5, "code": 0.3, "web": 0.2}), phases)
    mixture, _, draws = _draws(cfg, 12)
    for index, label in enumerate(mixture.labels):
        given = np.concatenate([d.sequences[d.sources == index] for d in draws])
        reader = MDSReader(str(datasets[label]), "train", cache_dir=None)
        alone = BlockShuffledSequences(
            reader, seq_len=SEQ, seed=source_seed(cfg.seed, label, mixture), block_mib=64, eos_id=EOS
        )
        assert (alone.next(len(given))[0] == given).all(), label
    after = np.concatenate([d.sources for d in draws[5:]])
    assert np.bincount(after, minlength=3).tolist() == [4, 4, 34]  # 42 sequences at 0.1/0.1/0.8, within one


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_resumed_stream_gives_the_uninterrupted_batches_on_any_number_of_ranks(tmp_path, datasets, world_size):
    cfg = _config(tmp_path, _spec(datasets, {"books": 0.5, "code": 0.3, "web": 0.2}))
    _, _, straight = _draws(cfg, 9)
    mixture = resolve_mixture(cfg)
    first, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
    for _ in range(4):
        first.next_labeled(BATCH)
    state = first.state_dict()
    rows = []
    for rank in range(world_size):
        stream, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
        stream.load_state_dict(state)
        batches = RankBatches(stream, global_batch=BATCH, micro_batch=1, rank=rank, world_size=world_size)
        rows.append([np.concatenate([t.numpy() for t in batches.next_step()]) for _ in range(5)])
    for step in range(5):
        assert (np.concatenate([r[step] for r in rows]) == straight[4 + step].sequences).all()


def _standalone(cfg, mixture, datasets, label: str) -> BlockShuffledSequences:
    """Source ``label``'s order stream alone, as the mixture seeds it."""
    reader = MDSReader(str(datasets[label]), "train", cache_dir=None)
    return BlockShuffledSequences(
        reader, seq_len=SEQ, seed=source_seed(cfg.seed, label, mixture), block_mib=64, eos_id=EOS
    )


def test_drawing_ahead_changes_no_sequence_epoch_or_resume(tmp_path, datasets, monkeypatch):
    """The mixture reads its sources ahead of the position (``READ_AHEAD_TOKENS``), here 3 steps at a time: the
    sequences equal those drawn in one read-ahead of the whole run; each source's epoch after every step equals its
    own stream's after as many sequences; and a state saved after any step, inside a read-ahead or at its end,
    resumes to the uninterrupted steps and epochs."""
    steps = 100  # every source passes its first epoch (books: about 230 sequences, drawn 300 times)
    cfg = _config(tmp_path, _spec(datasets, {"books": 0.5, "code": 0.3, "web": 0.2}))
    mixture, _, whole = _draws(cfg, steps)
    monkeypatch.setattr(mixture_module, "READ_AHEAD_TOKENS", 3 * BATCH * SEQ)
    stream, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
    states, epochs = [], []
    for step in range(steps):
        states.append(stream.state_dict())
        draw = stream.next_labeled(BATCH)
        assert (draw.sequences == whole[step].sequences).all() and (draw.keys == whole[step].keys).all(), step
        epochs.append(stream.epochs())
    counts = np.cumsum([np.bincount(d.sources, minlength=3) for d in whole], axis=0)
    for index, label in enumerate(mixture.labels):
        alone = _standalone(cfg, mixture, datasets, label)
        expected, drawn = [], 0
        for step in range(steps):
            if counts[step, index] > drawn:
                alone.next(int(counts[step, index]) - drawn)
                drawn = int(counts[step, index])
            expected.append(alone.epoch)
        assert [e[label] for e in epochs] == expected, label
        assert max(expected) >= 1, label  # the epochs did change
    at = [s["mixture"]["streams_at"] for s in states]
    assert at[:7] == [0, 0, 0, 18, 18, 18, 36]  # inside a read-ahead: its start; at its end: the position itself
    uneven, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
    sizes = [5, 7, 1, 11, 6, 13, 2, 9]  # requests that end inside a read-ahead and ones that cross into the next
    drawn = [uneven.next_labeled(size) for size in sizes]
    everything = np.concatenate([d.sequences for d in whole])[: sum(sizes)]
    assert (np.concatenate([d.sequences for d in drawn]) == everything).all()
    assert (
        np.concatenate([d.sources for d in drawn]).tolist()
        == np.concatenate([d.sources for d in whole])[: sum(sizes)].tolist()
    )
    for step in list(range(8)) + [31, 47]:
        resumed, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
        resumed.load_state_dict(states[step])
        for later in range(step, min(step + 5, steps)):
            assert (resumed.next_labeled(BATCH).sequences == whole[later].sequences).all(), (step, later)
            assert resumed.epochs() == epochs[later], (step, later)


def test_a_mixture_position_whose_streams_stand_past_it_is_refused():
    from data_prep.json_file import Fields, JsonFileError
    from pipeline.train.checkpoint import _check_data_position

    state = {"mixture": {"consumed": 12, "streams_at": 13, "sources": {}, "phases": [], "streams": {}}}
    with pytest.raises(JsonFileError, match=r"field 'data.mixture.streams_at' is 13, expected an integer in \[0, 12\]"):
        _check_data_position(Fields(state, "state.json", "data."))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("{books: -1}", r"data\.sources\[0\]\.weight|the weight of 'books' in data\.sources = -1\.0"),
        ("{books: .nan}", r"data\.sources\[0\]\.weight must be a finite number; got nan"),
        ("{books: 0}", "data.sources: the weights sum to 0"),
    ],
)
def test_bad_weights_are_one_line_errors(tmp_path, datasets, weights, message):
    weight = weights.split(": ")[1].rstrip("}")
    with pytest.raises(ConfigError, match=message) as err:
        resolve_mixture(_config(tmp_path, f"data.sources=[{{path: {datasets['books']}, weight: {weight}}}]"))
    assert "\n" not in str(err.value)


def test_an_unknown_label_a_twice_used_label_and_a_retrieval_fraction_are_refused(tmp_path, datasets):
    spec = _spec(datasets, {"books": 0.5, "code": 0.5})
    with pytest.raises(ConfigError, match=r"data\.phases\[0\]\.weights names \['nope'\], which no source has"):
        resolve_mixture(_config(tmp_path, spec, "data.phases=[{start_step: 2, weights: {nope: 1}}]"))
    twice = f"data.sources=[{{path: {datasets['books']}}}, {{path: {datasets['code']}, label: books}}]"
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.label='books' is used twice"):
        resolve_mixture(_config(tmp_path, twice))
    with pytest.raises(ConfigError, match="declare the retrieval tasks as a source instead"):
        resolve_mixture(_config(tmp_path, spec, "data.retrieval_mix.fraction=0.1"))
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.min_doc_tokens=100 must be 0 or a power of two"):
        resolve_mixture(_config(tmp_path, _spec(datasets, {"books": 1}, books=", min_doc_tokens: 100")))


def test_a_source_too_small_for_its_share_is_named_with_its_tokens_and_the_need(tmp_path, datasets):
    small = _spec(datasets, {"books": 0.5, "web": 0.5}, web=", max_repeat: 1").replace("max_repeat: 100, max", "max")
    cfg = _config(tmp_path, small, "train.max_steps=200")
    tokens = fmt.read_manifest(datasets["web"]).splits["train"]
    available = tokens.tokens + tokens.documents
    need = 600 * SEQ  # half of 200 x 6 sequences
    with pytest.raises(ConfigError) as err:
        check_mixture(cfg)
    assert str(err.value) == (
        f"data.sources[1] (web) is too small for its share: it holds {available:,} tokens, the run reads {need:,} "
        f"from it over train.max_steps=200 ({need / available:.2f} epochs) but max_repeat=1; raise its max_repeat, "
        "lower its weight or train.max_steps, or add data"
    )


def test_a_source_of_another_tokenizer_is_refused_before_any_work(tmp_path, datasets, caplog):
    from pipeline.train.trainer import main

    other = _dataset(tmp_path, "web", 20, 9, train_test_tokenizer(["another corpus of words"] * 50, 40))
    spec = f"data.sources=[{{path: {datasets['books']}}}, {{path: {other}, label: other}}]"
    base = {**TINY_TRAIN_OVERRIDES, "run_dir": tmp_path / "run"}
    with caplog.at_level(logging.INFO):
        assert main(None, [*(f"{k}={v}" for k, v in base.items()), spec]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("configuration error: data.sources: source 'other' was tokenized with another tokenizer")
    assert not (tmp_path / "run").exists()


def test_the_budget_table_counts_what_the_schedule_draws(tmp_path, datasets, caplog):
    cfg = _config(tmp_path, _spec(datasets, {"books": 0.5, "code": 0.3, "web": 0.2}), "train.max_steps=10")
    with caplog.at_level(logging.INFO):
        check_mixture(cfg)
    drawn = Schedule(resolve_mixture(cfg).phases).counts(60, 3) * SEQ
    assert drawn.tolist() == [1920, 1152, 768]
    for name, tokens in zip(SIZES, drawn):
        split = fmt.read_manifest(datasets[name]).splits["train"]
        available = split.tokens + split.documents
        assert f"{available:,}" in caplog.text and f"{int(tokens):,}" in caplog.text
        assert f"{tokens / available:.2f}" in caplog.text


# ---------------------------------------------------------------- resume rules


def _record(weights: list[dict[str, str]], starts: list[int]) -> dict:
    sources = {"books": {"task": "text", "index_sha256": "a"}, "web": {"task": "text", "index_sha256": "b"}}
    return {"sources": sources, "phases": [{"start": s, "weights": w} for s, w in zip(starts, weights)]}


def test_a_past_or_current_phase_is_frozen_and_a_later_one_is_free():
    saved = _record([{"books": "1/2", "web": "1/2"}], [0])
    later = _record([{"books": "1/2", "web": "1/2"}, {"web": "1"}], [0, 60])
    check_mixture_resume(saved, later, consumed=30)  # a phase added after the position
    check_mixture_resume(saved, later, consumed=60)  # one starting at the position has drawn nothing yet
    check_mixture_resume(later, saved, consumed=60)  # and may go again
    with pytest.raises(MixtureResumeError, match="a past or current phase cannot be added, moved or removed"):
        check_mixture_resume(later, saved, consumed=61)
    with pytest.raises(MixtureResumeError, match=r"data\.sources\[\*\]\.weight: the weights of a past or current"):
        check_mixture_resume(saved, _record([{"books": "1/3", "web": "2/3"}], [0]), consumed=30)
    with pytest.raises(MixtureResumeError, match="a past or current phase cannot be added, moved or removed"):
        check_mixture_resume(saved, _record([{"books": "1/2", "web": "1/2"}, {"web": "1"}], [0, 24]), consumed=30)
    changed = _record([{"books": "1/2", "web": "1/2"}], [0])
    changed["sources"]["web"] = {"task": "text", "index_sha256": "c"}
    with pytest.raises(MixtureResumeError, match=r"the source 'web' changed since the checkpoint \(index_sha256\)"):
        check_mixture_resume(saved, changed, consumed=30)


def test_a_run_resumed_with_changed_current_weights_stops_in_one_line(tmp_path, datasets, caplog):
    from pipeline.train.trainer import main

    base = {**TINY_TRAIN_OVERRIDES, "run_dir": tmp_path / "run", "checkpoint.every": 2, "train.max_steps": 2}
    base["schedule.warmup_steps"] = 0
    args = [f"{k}={v}" for k, v in base.items()]
    assert main(None, [*args, _spec(datasets, {"books": 0.5, "web": 0.5})]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(None, [*args, "train.max_steps=4", _spec(datasets, {"books": 0.25, "web": 0.75})]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "\n" not in error and "the weights of a past or current phase changed" in error
    later = "data.phases=[{start_step: 3, weights: {web: 1}}]"
    assert main(None, [*args, "train.max_steps=4", _spec(datasets, {"books": 0.5, "web": 0.5}), later]) == 0


def test_one_dataset_keeps_the_position_it_always_recorded(tmp_path, datasets):
    """``data.path`` alone is one source: its state is its stream's, plus the sequences drawn; a state written
    before mixtures (without that count) resumes at the same place."""
    cfg = _config(tmp_path, f"data.path={datasets['books']}")
    mixture = resolve_mixture(cfg)
    assert not mixture.declared and mixture.labels == ["books"]
    stream, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
    for _ in range(3):
        stream.next_labeled(BATCH)
    state = stream.state_dict()
    assert state["mixture_consumed"] == 3 * BATCH and state["order"] == "blocks"
    expected = stream.next_labeled(BATCH).sequences
    old = {k: v for k, v in state.items() if k != "mixture_consumed"}
    again, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
    again.load_state_dict(old)
    assert again.consumed == 3 * BATCH and (again.next_labeled(BATCH).sequences == expected).all()


def test_the_retrieval_tasks_are_a_source_of_their_fraction_at_every_prefix(tmp_path, datasets):
    cfg = _config(tmp_path, f"data.path={datasets['books']}", "data.retrieval_mix.fraction=0.3")
    mixture = resolve_mixture(cfg)
    assert mixture.labels == ["books", "retrieval"]
    assert abs(mixture.phases[0].weights[1] - Fraction(3, 10)) <= Fraction(1, 1 << 16)
    _, _, draws = _draws(cfg, 10)
    tasks = np.concatenate([d.tasks for d in draws])
    assert all(abs(tasks[:n].sum() - 0.3 * n) < 1 for n in range(1, len(tasks) + 1))
    assert math.isclose(tasks.mean(), 0.3, abs_tol=1 / len(tasks))


# ---------------------------------------------------------------- length buckets


def test_a_length_bucket_takes_whole_documents_of_its_lengths_only(tmp_path):
    """A source over the documents of 64 to 127 tokens: one epoch holds the tokens of exactly those documents, each
    with its EOS, less than one sequence short (a document that crosses shards is judged by its whole length, not by
    its pieces), and nothing of any other document (the EOS aside: one per piece of a document)."""
    data = _dataset(tmp_path, "books", 150, 3, _tokenizer_bytes(), histograms=True)
    reader = MDSReader(str(data), "train", cache_dir=None)
    pieces: dict[int, list[np.ndarray]] = {}
    for shard in range(reader.num_shards):
        for index in range(int(reader.samples_per_shard[shard])):
            tokens, doc = reader.sample(shard, index)
            pieces.setdefault(doc, []).append(tokens.astype(np.int64))
    documents = {doc: np.concatenate(parts) for doc, parts in pieces.items()}
    in_bucket = [tokens for tokens in documents.values() if 64 <= len(tokens) < 128]
    assert any(
        len(documents[int(d)]) in range(64, 128)
        for d in fmt.read_manifest(data).splits["train"].length_histogram.spanning_documents
    )
    cfg = _config(tmp_path, f"data.sources=[{{path: {data}, min_doc_tokens: 64, max_doc_tokens: 128, max_repeat: 9}}]")
    stream, _ = build_stream(cfg, resolve_mixture(cfg), EOS, cache=str(tmp_path / "cache"))
    expected = np.bincount(np.concatenate([np.r_[tokens, EOS] for tokens in in_bucket]), minlength=64)
    per_epoch = int(expected.sum()) // SEQ  # one block: less than one sequence is left out
    drawn = np.bincount(np.concatenate([stream.next_labeled(1).sequences[0] for _ in range(per_epoch)]), minlength=64)
    assert stream.epochs() == {"books": 0}
    text = np.arange(64) != EOS  # a document that crosses shards is joined as one segment per shard, each with EOS
    assert (drawn[text] <= expected[text]).all() and expected[text].sum() - drawn[text].sum() < SEQ
    stream.next_labeled(1)
    assert stream.epochs() == {"books": 1}
    histogram = fmt.read_manifest(data).splits["train"].length_histogram
    assert fmt.bucket_tokens(histogram, 64, 128) == (len(in_bucket), sum(len(t) for t in in_bucket))


def test_the_documented_recipe_resolves_to_its_stated_shares():
    cfg = load_config(Path(__file__).parents[2] / "configs/train/gca_mix_16k.yaml", [], 8)
    mixture = resolve_mixture(cfg)
    assert mixture.labels == ["books", "code", "short", "retrieval"] and cfg.data.path == "data/books"
    assert [float(w) for w in mixture.phases[0].weights] == pytest.approx([0.28, 0.28, 0.39, 0.05], abs=2**-16)
    assert [p.start for p in mixture.phases] == [0, 50000 * 32]
    assert [s.bucket for s in mixture.sources] == [(16384, None), (16384, None), (0, None), (0, None)]
    assert mixture.sources[3].host == "books"


def test_a_declared_retrieval_source_writes_tasks_over_its_host_in_its_share(tmp_path, datasets):
    """``task: retrieval`` in ``data.sources``: its sequences are its host's text with a task written over them
    (the families of ``data.retrieval_mix``), in its share of every step."""
    cfg = _config(
        tmp_path,
        "train.seq_len=256",
        "model.chunk_size=16",
        "model.window=32",
        "data.retrieval_mix.families={single: 1}",
        f"data.sources=[{{path: {datasets['books']}, weight: 0.5, max_repeat: 99}}, "
        "{task: retrieval, weight: 0.5, label: tasks}]",
    )
    from pipeline.data.reader import read_tokenizer
    from pipeline.train.inputs import build_mix

    mixture = resolve_mixture(cfg)
    assert mixture.sources[1].host == "books"
    stream, _ = build_stream(cfg, mixture, EOS, cache=str(tmp_path / "cache"))
    mix = build_mix(cfg, read_tokenizer(str(datasets["books"])))
    assert mix is not None and mix.describe()["fraction"] == 0.5
    batches = RankBatches(stream, global_batch=BATCH, micro_batch=1, rank=0, world_size=1, mix=mix, seed=cfg.seed)
    for _ in range(4):
        rows = np.concatenate([t.numpy() for t in batches.next_step()])
        tasks = batches.step_sources == 1
        assert tasks.sum() == 3
        for row, is_task in zip(rows, tasks):
            low, high = RANGES["books"]
            text = row[row != EOS]
            assert ((text >= low) & (text < high)).all() != is_task  # a task writes words of the tokenizer over it
    assert batches.families == {"single": 12}


def test_a_base_config_s_data_path_of_another_tokenizer_is_refused(tmp_path, datasets):
    """``data.sources`` added over a config whose ``data.path`` names another dataset: that path would give the run
    its tokenizer and vocabulary, so a tokenizer other than the sources' is a one-line error naming the fix."""
    other = _dataset(tmp_path, "web", 20, 9, train_test_tokenizer(["another corpus of words"] * 50, 40))
    spec = _spec(datasets, {"books": 0.5, "code": 0.5})
    with pytest.raises(ConfigError) as err:
        check_mixture(_config(tmp_path, f"data.path={other}", spec))
    assert str(err.value).startswith(f"data.path={other} was tokenized with another tokenizer than the sources")
    assert str(err.value).endswith(f"set data.path={datasets['books']} (the first source), or leave it out")
    check_mixture(_config(tmp_path, f"data.path={datasets['web']}", spec))  # the same tokenizer: accepted


def test_no_run_output_may_go_inside_any_source_dataset(tmp_path, datasets):
    """Every source is a dataset that is only read: a run_dir or cache inside one (also through a symlink to it) is
    refused at load, naming the source, before anything is written."""
    spec = _spec(datasets, {"books": 0.5, "code": 0.5})
    inside = datasets["code"] / "runs" / "x"
    with pytest.raises(ConfigError, match=rf"run_dir={inside} is inside data\.sources\[1\]\.path="):
        _config(tmp_path, spec, f"run_dir={inside}")
    link = tmp_path / "code_link"
    link.symlink_to(datasets["code"])
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* is inside data\.sources\[1\]\.path="):
        _config(tmp_path, spec, f"data.cache_dir={link / 'cache'}")
    with pytest.raises(ConfigError, match=r"run_dir=.* is inside data\.path="):
        _config(tmp_path, f"data.path={datasets['books']}", f"run_dir={datasets['books'] / 'run'}")
    assert not inside.exists() and not (datasets["code"] / "cache").exists()

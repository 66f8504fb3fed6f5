"""Far recall (``pipeline.evaluation.far_recall``): the targets against a naive O(N^2) scan, the closed-form random
rate against brute-force enumeration, an oracle retriever run through the model scores 1.0 (and controls with the
row or the target shifted by one do not), and the random retriever (``model.retrieval=random``) matches the
closed form."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers import tiny_config

import model.gca as gca_module
from model import GCAForCausalLM
from model.retrieval import RetrievalRows
from pipeline.evaluation.far_recall import (
    FarRecall,
    far_targets,
    nearest_far_chunks,
    picked_chunks,
    random_hit_rate,
    sliding_reach,
)


def naive_targets(tokens, *, chunk_size, reach, n, scored=None) -> dict[int, set[int]]:
    """Target position t -> its target chunks, by comparing every earlier n-gram end e with t's n-gram: the
    prediction of x[t] is made at input position p = t - 1, which reads the row of landmark p // S - 1, whose
    visible chunks are 0 .. p // S - 2; an occurrence counts when p - e > reach and its chunk is visible."""
    tokens = list(tokens)
    out: dict[int, set[int]] = {}
    for t in scored if scored is not None else range(1, len(tokens)):
        if t < n - 1:
            continue
        p = t - 1
        chunks = {
            e // chunk_size
            for e in range(n - 1, t)
            if tokens[e - n + 1 : e + 1] == tokens[t - n + 1 : t + 1]
            and p - e > reach
            and e // chunk_size <= p // chunk_size - 2
        }
        if chunks:
            out[t] = chunks
    return out


CASES = [  # (vocab, length, chunk_size, reach, n): reach below, at and above 2 chunks; n = 1 and 2 too
    (3, 300, 4, 0, 4),
    (3, 300, 4, 7, 4),
    (3, 300, 5, 23, 3),
    (2, 200, 3, 10, 4),
    (4, 257, 7, 40, 2),
    (5, 150, 1, 3, 1),
    (3, 60, 8, 100, 4),  # reach past the whole sequence: nothing qualifies
]


@pytest.mark.parametrize("vocab,length,chunk_size,reach,n", CASES)
def test_targets_match_a_naive_scan(vocab, length, chunk_size, reach, n):
    rng = np.random.default_rng(length + reach)
    tokens = rng.integers(0, vocab, length)
    want = naive_targets(tokens, chunk_size=chunk_size, reach=reach, n=n)
    got = far_targets(tokens, chunk_size=chunk_size, reach=reach, n=n)
    assert got.position.tolist() == sorted(want)
    assert got.chunks.tolist() == [len(want[t]) for t in sorted(want)]
    assert got.row.tolist() == [(t - 1) // chunk_size - 1 for t in sorted(want)]
    assert got.visible.tolist() == got.row.tolist()
    if length < 100:
        assert not want
        return
    assert len(want) > 10  # the cases exercise something
    # hits: random picks among the visible chunks (padding -1 included) against the naive sets.
    k = 3
    picked = np.full((len(got), k), -1)
    for i, V in enumerate(got.visible.tolist()):
        chosen = rng.choice(V, size=min(k, V), replace=False)
        picked[i, : len(chosen)] = chosen
    want_hits = [bool(set(picked[i][picked[i] >= 0].tolist()) & want[t]) for i, t in enumerate(sorted(want))]
    assert got.hits(picked).tolist() == want_hits
    assert 0 < sum(want_hits) < len(want_hits)
    # Each target chunk alone is a hit; the visible chunks outside the set are not.
    for i, t in enumerate(sorted(want)):
        V = int(got.visible[i])
        inside = sorted(want[t])
        outside = [j for j in range(V) if j not in want[t]]
        single = np.array([[j] for j in inside + outside] or [[-1]])
        rows = np.full(len(single), i)
        sub = _select(got, rows)
        assert sub.hits(single).tolist() == [True] * len(inside) + [False] * len(outside)


def _select(targets, rows):
    """The targets ``rows`` (with repeats) of a ``FarTargets``, to ask one target several single-pick questions."""
    from dataclasses import replace

    return replace(
        targets,
        position=targets.position[rows],
        row=targets.row[rows],
        visible=targets.visible[rows],
        chunks=targets.chunks[rows],
        _gram=targets._gram[rows],
        _limit=targets._limit[rows],
    )


def test_scored_range_restricts_the_targets():
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 3, 400)
    scored = range(300, 400)
    want = naive_targets(tokens, chunk_size=4, reach=9, n=4, scored=scored)
    got = far_targets(tokens, chunk_size=4, reach=9, n=4, scored=scored)
    assert got.position.tolist() == sorted(want) and len(want) > 20
    assert got.chunks.tolist() == [len(want[t]) for t in sorted(want)]
    with pytest.raises(ValueError, match="scored"):
        far_targets(tokens, chunk_size=4, reach=9, scored=range(0, 10))


@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
def test_random_rate_is_the_fraction_of_hitting_pick_sets(top_k):
    """1 - C(V-m, k)/C(V, k) against counting the k-subsets of V chunks that contain one of m target chunks."""
    for V in range(1, 9):
        for m in range(1, V + 1):
            k = min(top_k, V)
            subsets = list(itertools.combinations(range(V), k))
            hitting = sum(1 for s in subsets if min(s) < m)  # targets: chunks 0 .. m-1
            got = random_hit_rate(np.array([V]), np.array([m]), top_k)[0]
            assert got == pytest.approx(hitting / len(subsets), abs=1e-12), (V, m, top_k)


@pytest.mark.parametrize("vocab,length,chunk_size,reach,n", CASES[:5])
@pytest.mark.parametrize("top_k", [1, 3])
def test_nearest_rule_matches_a_naive_scan(vocab, length, chunk_size, reach, n, top_k):
    """The recency rule's picks, by scanning every chunk: the top_k largest visible chunk ids holding a position
    more than ``reach`` before the input position; its hits, against the naive targets."""
    tokens = np.random.default_rng(length + top_k).integers(0, vocab, length)
    targets = far_targets(tokens, chunk_size=chunk_size, reach=reach, n=n)
    picks = nearest_far_chunks(targets, chunk_size=chunk_size, reach=reach, top_k=top_k)
    naive = naive_targets(tokens, chunk_size=chunk_size, reach=reach, n=n)
    assert len(naive) == len(targets) > 0
    hits = 0
    for i, t in enumerate(targets.position.tolist()):
        p = t - 1
        usable = [j for j in range(p // chunk_size - 1) if j * chunk_size <= p - reach - 1]
        want = sorted(usable, reverse=True)[:top_k]
        assert picks[i].tolist() == want + [-1] * (top_k - len(want)), t
        hits += bool(set(want) & naive[t])
    assert int(targets.hits(picks).sum()) == hits


def test_sums_add_and_read_back():
    a = FarRecall(tokens=10, random=2.5, nearest=3, hits=[4, 6])
    b = FarRecall(tokens=30, random=7.5, nearest=9, hits=[10, 2])
    total = FarRecall.empty(2) + a + b
    assert total == FarRecall(40, 10.0, 12, [14, 8])
    assert FarRecall.from_sums(total.as_sums()) == total
    assert total.metrics("retrieval/") == {
        "retrieval/far_recall": 22 / 80,
        "retrieval/far_recall_random": 0.25,
        "retrieval/far_recall_nearest": 12 / 40,
        "retrieval/far_recall_tokens": 40,
        "retrieval/far_recall_g0": 14 / 40,
        "retrieval/far_recall_g1": 8 / 40,
    }
    assert FarRecall.empty(1).metrics() == {
        "far_recall": None,
        "far_recall_random": None,
        "far_recall_nearest": None,
        "far_recall_tokens": 0,
    }
    with pytest.raises(ValueError, match="groups"):
        _ = a + FarRecall.empty(1)


# ---------------------------------------------------------------- through the model

CHUNK, TOP_K = 4, 4  # top_k = chunk_size: one row can serve a target chunk to every token it serves


def _tokens(batch: int, length: int, seed: int, symbols: int = 4) -> torch.Tensor:
    """Random tokens over a few symbols, so that 4-grams recur often."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, symbols, (batch, length)))


def _oracle(ids: torch.Tensor, cfg, *, row_shift: int = 0, target_shift: int = 0):
    """A ``retrieve`` that gives row ``r`` (landmark of chunk ``r``), for every token of chunk ``r + 1 + row_shift``
    at input position p, the smallest target chunk of the target ``t = p + 1 + target_shift`` (naive scan)."""
    reach = sliding_reach(cfg)
    sets = [naive_targets(row.tolist(), chunk_size=CHUNK, reach=reach, n=4) for row in ids]

    def retrieve(queries, keys, query_chunk, *, top_k, **_):
        B, Cq = queries.shape[0], len(query_chunk)
        index = torch.zeros(B, Cq, top_k, dtype=torch.long)
        weights = torch.zeros(B, Cq, top_k)
        for b in range(B):
            for i, r in enumerate(query_chunk.tolist()):
                served = range((r + 1 + row_shift) * CHUNK, (r + 2 + row_shift) * CHUNK)
                want = sorted({min(sets[b][p + 1 + target_shift]) for p in served if p + 1 + target_shift in sets[b]})
                want = [j for j in want if j < r][:top_k]  # what the row can see
                index[b, i, : len(want)] = torch.tensor(want, dtype=torch.long)
                weights[b, i, : len(want)] = 1.0 / max(1, len(want))
        return RetrievalRows(index, weights)

    return retrieve


def _far_recall(model: GCAForCausalLM, ids: torch.Tensor) -> FarRecall:
    model.picks = {}
    with torch.no_grad():
        model(ids)
    picks, model.picks = model.picks, None
    return sum(
        (FarRecall.measure(ids[b].numpy(), picks, model.cfg, batch_row=b) for b in range(len(ids))),
        FarRecall.empty(len(model.cfg.groups)),
    )


def test_an_oracle_retriever_has_far_recall_one(monkeypatch):
    """Rows that hold a target chunk for every token they serve score 1.0 through the model's recording hook;
    the same oracle aimed one chunk late, or at the input token instead of the predicted one, scores less."""
    cfg = tiny_config(chunk_size=CHUNK, top_k=TOP_K, window=4, groups=[1, 1])
    model = GCAForCausalLM(cfg).eval()
    ids = _tokens(2, 400, seed=0)
    results = {}
    for name, shift in {"oracle": {}, "row+1": {"row_shift": 1}, "target-1": {"target_shift": -1}}.items():
        monkeypatch.setattr(gca_module, "retrieve", _oracle(ids, cfg, **shift))
        results[name] = _far_recall(model, ids)
    oracle = results["oracle"]
    assert oracle.tokens > 200
    assert oracle.metrics()["far_recall"] == 1.0 and oracle.hits == [oracle.tokens] * 2
    for control in ("row+1", "target-1"):
        assert results[control].tokens == oracle.tokens
        assert results[control].metrics()["far_recall"] < 0.9, control


def test_recording_does_not_change_the_forward():
    cfg = tiny_config(chunk_size=CHUNK, top_k=TOP_K, window=4)
    model = GCAForCausalLM(cfg).train()
    ids = _tokens(2, 96, seed=1)
    torch.manual_seed(3)
    plain = model(ids, labels=ids).loss
    state = torch.get_rng_state()
    torch.manual_seed(3)
    model.picks = {}
    recorded = model(ids, labels=ids).loss
    assert torch.equal(plain, recorded) and torch.equal(torch.get_rng_state(), state)
    assert sorted(model.picks) == [(0, c) for c in range(96 // CHUNK)]
    assert all(len(row) == min(c, TOP_K) for (_, c), rows in model.picks.items() for row in rows)


def test_random_retriever_far_recall_matches_the_closed_form():
    """``model.retrieval=random``: the measured far recall is within 4 standard errors of the closed form. Tokens of
    one row share its picks, so the bound takes the rows as the independent draws: a row serving ``n_r`` scored
    targets adds at most ``n_r^2 / 4`` to the variance of the hit count."""
    cfg = tiny_config(chunk_size=CHUNK, top_k=TOP_K, window=4, groups=[1, 1], retrieval="random")
    model = GCAForCausalLM(cfg).eval()
    ids = _tokens(128, 256, seed=2, symbols=3)  # short rows over 3 symbols: a far-recall rate near 0.24
    torch.manual_seed(4)
    measured = _far_recall(model, ids)
    per_row = np.concatenate(
        [
            np.unique(far_targets(row.numpy(), chunk_size=CHUNK, reach=sliding_reach(cfg)).row, return_counts=True)[1]
            for row in ids
        ]
    )
    groups = len(cfg.groups)
    se = math.sqrt(groups * (per_row.astype(float) ** 2).sum() / 4) / (groups * measured.tokens)
    m = measured.metrics()
    assert measured.tokens > 20_000 and se < 0.005
    assert abs(m["far_recall"] - m["far_recall_random"]) < 4 * se, (m, se)
    assert 0.1 < m["far_recall_random"] < 0.9  # a rate that could be missed either way


def test_random_retriever_picks_uniformly_with_equal_weights():
    """Every visible chunk is picked equally often (chi-square-free check: within 5 binomial standard errors),
    never an invisible one, each pick at weight 1/k; the parameters are the learned model's."""
    from model.retrieval import retrieve

    n, C, k = 4000, 7, 3
    queries, keys = torch.randn(n, 1, 8), torch.randn(n, C, 8)
    rows = retrieve(queries, keys, torch.tensor([C]), top_k=k, scale=1.0, gumbel=False, random_picks=True)
    counts = torch.bincount(rows.index.flatten(), minlength=C).float()
    p = k / C
    assert (counts - n * p).abs().max() < 5 * math.sqrt(n * p * (1 - p))
    assert all(len(set(r)) == k for r in rows.index[:, 0].tolist())
    torch.testing.assert_close(rows.weights, torch.full_like(rows.weights, 1 / k))
    few = retrieve(queries[:2], keys[:2, :2], torch.tensor([2]), top_k=k, scale=1.0, gumbel=False, random_picks=True)
    assert (few.weights > 0).sum(-1).tolist() == [[2], [2]] and (few.index[few.weights > 0] < 2).all()
    learned = GCAForCausalLM(tiny_config())
    random = GCAForCausalLM(tiny_config(retrieval="random"))
    assert [(k, v.shape) for k, v in learned.state_dict().items()] == [
        (k, v.shape) for k, v in random.state_dict().items()
    ]


def test_picked_chunks_pads_and_names_a_missing_row():
    picks = {(0, 3): [[0, 2], [1]], (0, 1): [[], []]}
    got = picked_chunks(picks, 0, np.array([3, 1, 3]), batch_row=1, top_k=3)
    assert got.tolist() == [[1, -1, -1], [-1, -1, -1], [1, -1, -1]]
    with pytest.raises(KeyError, match="chunk 5"):
        picked_chunks(picks, 0, np.array([5]), batch_row=0, top_k=2)

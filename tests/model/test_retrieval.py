"""Causal chunk retrieval: the causal mask j < i, zero-weight padding, Gumbel top-k sampling."""

import torch

from model.retrieval import retrieve


def test_only_strictly_earlier_chunks_are_selected():
    torch.manual_seed(0)
    B, C, Dm, R = 3, 12, 16, 4
    keys = torch.randn(B, C, Dm)
    queries = torch.randn(B, C, Dm)
    rows = retrieve(queries, keys, torch.arange(C), top_k=R, scale=Dm**-0.5, gumbel=True)
    for i in range(C):
        valid = rows.weights[:, i] > 0
        assert (rows.index[:, i][valid] < i).all()
        # All min(R, i) visible chunks are used and the weights form a distribution over them.
        assert (valid.sum(-1) == min(R, i)).all()
        expected_total = 1.0 if i > 0 else 0.0
        torch.testing.assert_close(rows.weights[:, i].sum(-1), torch.full((B,), expected_total))


def test_weights_are_softmax_of_clean_scores_of_the_picks():
    torch.manual_seed(1)
    keys, queries = torch.randn(1, 9, 8), torch.randn(1, 1, 8)
    rows = retrieve(queries, keys, torch.tensor([9]), top_k=3, scale=0.5, gumbel=False)
    scores = (queries[0, 0] @ keys[0].T) * 0.5
    top = scores.topk(3)
    assert set(rows.index[0, 0].tolist()) == set(top.indices.tolist())
    torch.testing.assert_close(rows.weights[0, 0].sort().values, torch.softmax(top.values, -1).sort().values)


def test_gumbel_top1_samples_from_the_score_softmax():
    """Top-1 of Gumbel-perturbed scores is a draw from softmax(scores): compare frequencies to the closed form."""
    torch.manual_seed(2)
    n = 20000
    scores_keys = torch.tensor([[0.0], [1.0], [2.0], [-1.0]])  # key j scores j-th value against query 1
    keys = scores_keys.T.expand(n, 1, 4).transpose(1, 2)  # [n, 4, 1]
    queries = torch.ones(n, 1, 1)
    rows = retrieve(queries, keys, torch.tensor([4]), top_k=1, scale=1.0, gumbel=True)
    freq = torch.bincount(rows.index[:, 0, 0], minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(scores_keys[:, 0], 0), atol=0.015, rtol=0)


def test_invalid_picks_get_no_gradient_and_no_nan():
    keys = torch.randn(1, 5, 8, requires_grad=True)
    queries = torch.randn(1, 5, 8, requires_grad=True)
    rows = retrieve(queries, keys, torch.arange(5), top_k=4, scale=1.0, gumbel=False)
    (rows.weights * torch.randn_like(rows.weights)).sum().backward()
    assert torch.isfinite(keys.grad).all() and torch.isfinite(queries.grad).all()
    # Query 0 and 1 see nothing: their rows carry no gradient to their queries.
    assert queries.grad[0, :2].abs().max() == 0


def test_stop_gradient_switch():
    keys = torch.randn(1, 6, 8, requires_grad=True)
    rows = retrieve(torch.randn(1, 6, 8), keys, torch.arange(6), top_k=2, scale=1.0, gumbel=False, grad=False)
    assert not rows.weights.requires_grad


def test_model_records_retrieval_telemetry():
    from helpers import tiny_config

    from model import GCAForCausalLM

    cfg = tiny_config(
        vocab_size=32, d_model=32, ffn_hidden=32, n_lower_layers=2, groups=[1, 1], chunk_size=4, top_k=3, window=4
    )
    model = GCAForCausalLM(cfg)
    model(torch.randint(0, 32, (2, 40)))
    stats = model.retrieval_stats
    assert set(stats) == {f"retrieval_{k}_g{g}" for k in ("entropy", "distance") for g in (0, 1)}
    for g in (0, 1):
        assert 0.0 <= stats[f"retrieval_entropy_g{g}"] <= torch.log(torch.tensor(3.0)) + 1e-6
        assert stats[f"retrieval_distance_g{g}"] >= 2.0  # chunk i+1 reads chunks j < i


def test_telemetry_closed_form():
    from model.retrieval import RetrievalRows, retrieval_stats

    rows = RetrievalRows(torch.tensor([[[0, 2], [0, 0]]]), torch.tensor([[[0.5, 0.5], [0.0, 0.0]]]))
    stats = retrieval_stats(rows, torch.tensor([4, 1]))
    torch.testing.assert_close(stats["entropy"], torch.log(torch.tensor(2.0)))
    torch.testing.assert_close(stats["distance"], torch.tensor(0.5 * 5 + 0.5 * 3))


def test_eval_scores_in_query_slices_pick_what_one_call_picks(monkeypatch):
    """Without autograd the queries are scored in slices (bounded transient memory); every row is the row of the
    unsliced call."""
    import model.retrieval as retrieval

    torch.manual_seed(3)
    keys, queries = torch.randn(2, 50, 16), torch.randn(2, 13, 16)
    query_chunk = torch.arange(38, 51)
    with torch.no_grad():
        whole = retrieve(queries, keys, query_chunk, top_k=4, scale=0.25, gumbel=False)
        monkeypatch.setattr(retrieval, "_EVAL_SCORE_ELEMENTS", 2 * 50 * 3)  # slices of 3 queries, the last of 1
        sliced = retrieve(queries, keys, query_chunk, top_k=4, scale=0.25, gumbel=False)
    assert torch.equal(sliced.index, whole.index)
    torch.testing.assert_close(sliced.weights, whole.weights, rtol=1e-6, atol=1e-7)


def _fp64_rows(queries, keys, uniform, top_k, scale):
    """The retrieval of every query chunk ``i`` over chunks ``j < i``, in fp64 (an independent reference)."""
    scores = torch.einsum("bqd,bmd->bqm", queries.double(), keys.double()) * scale
    C = keys.shape[1]
    visible = torch.arange(C)[None, :] < torch.arange(C)[:, None]
    pick = scores.masked_fill(~visible, float("-inf"))
    if uniform is not None:
        pick = pick - torch.log(-torch.log(uniform.double().clamp(1e-10, 1.0 - 1e-7)))
    index = pick.topk(top_k, dim=-1).indices
    weights = torch.softmax(scores.gather(-1, index), dim=-1)
    return index, weights


def test_retrieval_is_scored_in_fp32_under_bf16_autocast():
    """Under autocast the scores, the Gumbel draw, the top-k and the softmax stay fp32: the picks equal an fp64
    reference's, the weights are fp32 and within fp32 rounding of it (in bf16 about 1 row in 100 picked another set
    and the weights were off by ~1e-2)."""
    torch.manual_seed(3)
    B, C, Dm, R = 4, 96, 32, 8
    queries, keys = torch.randn(B, C, Dm), torch.randn(B, C, Dm)
    for gumbel in (False, True):
        torch.manual_seed(4)
        uniform = torch.rand(B, C, C) if gumbel else None
        torch.manual_seed(4)  # the same draw again, made inside retrieve
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rows = retrieve(queries, keys, torch.arange(C), top_k=R, scale=1.0, gumbel=gumbel)
        index, weights = _fp64_rows(queries, keys, uniform, R, 1.0)
        assert rows.weights.dtype == torch.float32
        full = torch.arange(C) > R  # rows with more visible chunks than R (no padding to compare)
        assert torch.equal(rows.index[:, full].sort(-1).values, index[:, full].sort(-1).values)
        order = rows.index[:, full].argsort(-1), index[:, full].argsort(-1)
        torch.testing.assert_close(
            rows.weights[:, full].gather(-1, order[0]).double(),
            weights[:, full].gather(-1, order[1]),
            atol=1e-6,
            rtol=0,
        )

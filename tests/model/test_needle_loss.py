"""The retriever's supervised loss (``model.retrieval.needle_loss``): the cross-entropy of the asked needles under a
softmax over every visible chunk, checked against a naive loop, against the retrieval weights the model itself
computes when its top-k holds every chunk, and for the reason it exists: behind a zero GCA output projection (a
dense conversion) the LM loss gives the retriever no gradient and this loss does."""

import math

import pytest
import torch
from helpers import tiny_config

import model.gca as gca_module
from model import build_model
from model.retrieval import NEEDLE_CHUNK, NEEDLE_EACH, NEEDLE_QUERY, needle_loss


def _naive(queries, keys, row, query, targets, scale):
    scores = [float(queries[row, query].detach() @ keys[row, j].detach()) * scale for j in range(query)]
    return -math.log(sum(math.exp(scores[j]) for j in targets) / sum(math.exp(s) for s in scores))


def test_it_is_the_needles_share_of_a_softmax_over_every_visible_chunk():
    torch.manual_seed(0)
    B, C, D, scale = 4, 7, 8, 0.3
    queries = torch.randn(B, C, D, requires_grad=True)
    keys = torch.randn(B, C, D, requires_grad=True)
    labels = torch.zeros(B, C, dtype=torch.long)
    labels[0, 4], labels[0, 1] = NEEDLE_QUERY, NEEDLE_CHUNK  # one needle chunk
    labels[1, 6], labels[1, 0], labels[1, 2] = NEEDLE_QUERY, NEEDLE_CHUNK, NEEDLE_CHUNK  # a needle over two chunks
    labels[2, 3] = NEEDLE_CHUNK  # no query: not labelled
    labels[3, 2], labels[3, 5] = NEEDLE_QUERY, NEEDLE_CHUNK  # the needle comes after the query: nothing to learn
    loss = needle_loss(queries, keys, labels, scale=scale)
    expected = _naive(queries, keys, 0, 4, [1], scale) + _naive(queries, keys, 1, 6, [0, 2], scale)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert queries.grad is not None and keys.grad is not None
    assert torch.isfinite(queries.grad).all() and torch.isfinite(keys.grad).all()
    for row in (2, 3):  # rows without a usable label: exactly no gradient (not NaN)
        assert queries.grad[row].abs().sum() == 0 and keys.grad[row].abs().sum() == 0
    assert keys.grad[0, 5:].abs().sum() == 0  # chunks at or after the query are not candidates


def test_an_answer_read_through_several_rows_is_the_mean_of_their_terms():
    """An answer longer than a chunk marks every row that serves it; the sequence's term is the mean of those rows'
    terms (it weighs one, as a one-row answer does), and a marked row with no needle before it counts for
    nothing."""
    torch.manual_seed(3)
    B, C, D, scale = 2, 9, 8, 0.5
    queries = torch.randn(B, C, D)
    keys = torch.randn(B, C, D)
    labels = torch.zeros(B, C, dtype=torch.long)
    labels[0, 5:8] = NEEDLE_QUERY  # three rows serve the answer
    labels[0, 1], labels[0, 3] = NEEDLE_CHUNK, NEEDLE_CHUNK
    labels[1, 2], labels[1, 5], labels[1, 3] = NEEDLE_QUERY, NEEDLE_QUERY, NEEDLE_CHUNK  # row 2 sees no needle
    loss = needle_loss(queries, keys, labels, scale=scale)
    first = sum(_naive(queries, keys, 0, q, [1, 3], scale) for q in (5, 6, 7)) / 3
    expected = first + _naive(queries, keys, 1, 5, [3], scale)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_each_marked_chunk_is_a_target_of_its_own():
    """``NEEDLE_EACH``: the mean of each chunk's own cross-entropy, so one chunk holding all the mass no longer
    satisfies it (the set form would be ~0 there); a single marked chunk gives the set form's value."""
    torch.manual_seed(4)
    B, C, D, scale = 2, 8, 8, 0.5
    queries, keys = torch.randn(B, C, D), torch.randn(B, C, D)
    labels = torch.zeros(B, C, dtype=torch.long)
    labels[0, 6:8] = NEEDLE_QUERY
    labels[0, 1], labels[0, 2], labels[0, 4] = NEEDLE_EACH, NEEDLE_EACH, NEEDLE_EACH
    labels[1, 5], labels[1, 3] = NEEDLE_QUERY, NEEDLE_EACH
    loss = needle_loss(queries, keys, labels, scale=scale)
    first = sum(_naive(queries, keys, 0, q, [j], scale) for q in (6, 7) for j in (1, 2, 4)) / 6
    expected = first + _naive(queries, keys, 1, 5, [3], scale)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    as_set = labels.clone()
    as_set[as_set == NEEDLE_EACH] = NEEDLE_CHUNK
    assert needle_loss(queries[1:], keys[1:], as_set[1:], scale=scale).item() == pytest.approx(
        needle_loss(queries[1:], keys[1:], labels[1:], scale=scale).item(), rel=1e-6
    )
    keys_peaked = keys.clone()  # row 7's query points at chunk 1 only: the set's mass is ~1, each is not
    keys_peaked[0, 1] = queries[0, 7] * 50
    one = torch.zeros(1, C, dtype=torch.long)
    one[0, 7], one[0, 1], one[0, 2] = NEEDLE_QUERY, NEEDLE_CHUNK, NEEDLE_CHUNK
    assert needle_loss(queries[:1], keys_peaked[:1], one, scale=scale).item() < 1e-3
    one[0, 1], one[0, 2] = NEEDLE_EACH, NEEDLE_EACH
    assert needle_loss(queries[:1], keys_peaked[:1], one, scale=scale).item() > 10


def test_the_models_needle_loss_is_minus_the_log_of_the_weight_its_own_retrieval_gives_the_needle(monkeypatch):
    """With top-k = every chunk and no Gumbel noise (eval mode) the question row's retrieval weights are the softmax
    over every visible chunk that the loss scores, so the loss is -log of the needle's weight there."""
    torch.manual_seed(1)
    T, S = 64, 8
    model = build_model(tiny_config(vocab_size=64, chunk_size=S, top_k=T // S)).eval()
    captured = []

    def keep(*args, **kwargs):
        rows = real(*args, **kwargs)
        captured.append(rows)
        return rows

    real = gca_module.retrieve
    monkeypatch.setattr(gca_module, "retrieve", keep)
    x = torch.randint(0, 64, (2, T))
    labels = torch.zeros(2, T // S, dtype=torch.long)
    labels[0, 6], labels[0, 2] = NEEDLE_QUERY, NEEDLE_CHUNK
    labels[1, 5], labels[1, 0], labels[1, 3] = NEEDLE_QUERY, NEEDLE_CHUNK, NEEDLE_CHUNK
    out = model(x, labels=x, return_logits=False, retrieval_labels=labels)
    plain = model(x, labels=x, return_logits=False)
    assert plain.needle_loss is None and torch.equal(out.loss, plain.loss)  # the LM loss is left alone
    rows = captured[0]  # the group's rows of the labelled forward, row c = landmark c's retrieval
    expected = 0.0
    for b, (query, needles) in enumerate(((6, {2}), (5, {0, 3}))):
        picked = rows.index[b, query].tolist()
        mass = sum(float(rows.weights[b, query, r].detach()) for r, j in enumerate(picked) if j in needles)
        expected += -math.log(mass)
    assert out.needle_loss is not None
    assert out.needle_loss.item() == pytest.approx(expected / 2, rel=1e-4)  # a mean over the batch's rows


def test_behind_a_zero_gca_output_only_the_needle_loss_trains_the_retriever():
    torch.manual_seed(2)
    T, S = 64, 8
    # As a conversion makes it: tokens do not see landmarks, so the landmark reaches the LM loss only through GCA.
    model = build_model(tiny_config(vocab_size=64, chunk_size=S, tokens_see_landmarks=False))
    for group in model.groups:
        for layer in group.layers:
            torch.nn.init.zeros_(layer.gca.wo.weight)
            if layer.gca.wo.bias is not None:
                torch.nn.init.zeros_(layer.gca.wo.bias)
    x = torch.randint(0, 64, (2, T))
    labels = torch.zeros(2, T // S, dtype=torch.long)
    labels[:, 7], labels[:, 1] = NEEDLE_QUERY, NEEDLE_CHUNK
    retriever = {"landmark": model.landmark, "query_norm": model.groups[0].query_norm.weight}
    retriever["encoder norm"] = model.encoder.norm.weight

    model(x, labels=x, return_logits=False).loss.backward()
    for name, p in retriever.items():
        assert p.grad is None or p.grad.abs().sum() == 0, name
    model.zero_grad()
    out = model(x, labels=x, return_logits=False, retrieval_labels=labels)
    assert out.needle_loss is not None
    out.needle_loss.backward()
    for name, p in retriever.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_a_model_without_a_retriever_refuses_labels():
    model = build_model(tiny_config(vocab_size=64, arch="swa"))
    x = torch.randint(0, 64, (1, 32))
    with pytest.raises(ValueError, match="has no retriever to supervise"):
        model(x, labels=x, return_logits=False, retrieval_labels=torch.zeros(1, 4, dtype=torch.long))

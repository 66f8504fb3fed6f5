"""Each position's own loss from the training forward (what the trainer's per-source losses sum): the chunked loss
and the weighted loss return it beside the loss without changing one bit of the loss or of the gradients, and it is
the cross-entropy of each position as the full logits give it (unweighted, 0 where nothing is scored)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config

from model import build_model, lm_loss
from model.chunked_loss import chunked_lm_loss, chunked_lm_loss_and_token_losses
from model.lm import scored_positions, token_losses
from pipeline.train.parallel import next_token_loss, next_token_loss_rows

FP32 = dict(rtol=1e-5, atol=1e-6)


def _labels(B: int, T: int, V: int) -> torch.Tensor:
    labels = torch.randint(0, V, (B, T))
    labels[0, 3] = labels[1, 5] = labels[1, T - 1] = -100  # three positions score nothing, besides each last one
    return labels


@pytest.mark.parametrize("rows", [1, 7, 1000])  # one row a slice, a ragged last slice, everything at once
def test_chunked_token_losses_leave_the_loss_and_gradients_bitwise_alone(rows):
    torch.manual_seed(0)
    B, T, d, V = 2, 13, 8, 50
    h, weight, labels = torch.randn(B, T, d), torch.randn(V, d), _labels(B, T, V)
    results = []
    for with_rows in (False, True):
        a, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        if with_rows:
            loss, per_token = chunked_lm_loss_and_token_losses(a, w, labels, rows * V)
        else:
            loss, per_token = chunked_lm_loss(a, w, labels, rows * V), None
        (3 * loss).backward()
        results.append((loss.detach(), a.grad, w.grad, per_token))
    (ref, ref_h, ref_w, _), (got, got_h, got_w, per_token) = results
    assert torch.equal(got, ref) and torch.equal(got_h, ref_h) and torch.equal(got_w, ref_w)
    assert per_token is not None and per_token.shape == (B, T) and not per_token.requires_grad
    expected = token_losses(F.linear(h, weight), labels)
    torch.testing.assert_close(per_token, expected, **FP32)
    scored = scored_positions(labels)
    assert (per_token[~scored] == 0).all() and int(scored.sum()) == B * (T - 1) - 3
    torch.testing.assert_close(per_token.sum() / scored.sum(), ref, **FP32)  # the mean loss is their mean


def test_model_forward_token_loss_is_the_same_pass():
    torch.manual_seed(0)
    model = build_model(tiny_config(vocab_size=64)).eval()
    x = torch.randint(0, 64, (2, 32))
    plain = model(x, labels=x, return_logits=False)
    out = model(x, labels=x, return_logits=False, token_loss=True)
    assert plain.token_loss is None and torch.equal(out.loss, plain.loss)
    assert out.token_loss is not None and out.token_loss.shape == (2, 32)
    full = model(x, labels=x, token_loss=True)  # the logits path gives the same per-position losses
    assert full.token_loss is not None
    torch.testing.assert_close(out.token_loss, full.token_loss, **FP32)


@pytest.mark.parametrize("weighted", [False, True])
def test_row_stats_are_unweighted_sums_and_counts(weighted):
    """``next_token_loss_rows``: the trainer's loss unchanged (bitwise), and per row the unweighted cross-entropy
    summed over its scored positions, with their count, whatever the loss weights."""
    torch.manual_seed(0)
    model = build_model(tiny_config(vocab_size=64)).eval()
    x = torch.randint(0, 64, (3, 32))
    weights = torch.ones(3, 32)
    weights[1, 10:14] = 5.0  # an answer span weighed up, as the retrieval mix's answer_weight does
    w = weights if weighted else None
    norm = torch.tensor(40.0) if weighted else None
    loss, rows = next_token_loss_rows(model, x, w, norm)
    assert torch.equal(loss, next_token_loss(model, x, w, norm))
    with torch.no_grad():
        logits = model(x).logits
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(3, 31)
    torch.testing.assert_close(rows[:, 0], ce.sum(1), **FP32)
    assert rows[:, 1].tolist() == [31.0, 31.0, 31.0]
    if weighted:
        torch.testing.assert_close(loss, lm_loss(logits, x, weights, norm), **FP32)
    else:
        torch.testing.assert_close(loss, rows[:, 0].sum() / rows[:, 1].sum(), **FP32)

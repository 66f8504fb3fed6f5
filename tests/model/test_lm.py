"""The shared next-token loss and parameter count, against sums written out by hand."""

import math

import torch

from model import lm_loss
from model.lm import count_parameters


def _reference_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per predicted position ``-log softmax(logits[:, t])[labels[:, t + 1]]``, in fp64, shape ``[B, T-1]``."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return -logp.gather(-1, labels[:, 1:, None]).squeeze(-1)


def test_mean_loss_matches_reference_and_skips_ignored_labels():
    logits = torch.randn(2, 7, 11)
    labels = torch.randint(0, 11, (2, 7))
    ce = _reference_ce(logits, labels)
    torch.testing.assert_close(lm_loss(logits, labels).double(), ce.mean(), rtol=1e-6, atol=0)
    ignored = labels.clone()
    ignored[0, 3] = -100  # the target of position 2
    kept = torch.ones_like(ce, dtype=torch.bool)
    kept[0, 2] = False
    ce_kept = _reference_ce(logits, labels.clamp_min(0))[kept]
    torch.testing.assert_close(lm_loss(logits, ignored).double(), ce_kept.mean(), rtol=1e-6, atol=0)


def test_weighted_loss_is_the_weighted_mean_over_predicted_positions():
    logits = torch.randn(2, 6, 9)
    labels = torch.randint(0, 9, (2, 6))
    weights = torch.rand(2, 6)
    ce = _reference_ce(logits, labels)
    w = weights[:, 1:].double()
    expected = (ce * w).sum() / w.sum()
    torch.testing.assert_close(lm_loss(logits, labels, weights).double(), expected, rtol=1e-6, atol=0)
    # Unit weights give the plain mean, bit for bit up to summation order.
    torch.testing.assert_close(lm_loss(logits, labels, torch.ones(2, 6)), lm_loss(logits, labels))


def test_count_parameters_counts_a_shared_tensor_once():
    lin = torch.nn.Linear(3, 4)
    tied = torch.nn.ModuleList([lin, lin])
    assert count_parameters(tied) == 3 * 4 + 4
    assert count_parameters(torch.nn.Embedding(5, 2)) == math.prod((5, 2))

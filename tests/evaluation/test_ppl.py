"""Perplexity = exp(mean NLL) of a plain full forward; segment-wise streaming changes nothing."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.evaluation.ppl import evaluate_ppl, window_nll


def _full_forward_nll(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
    logp = F.log_softmax(logits[:, :-1].double(), dim=-1)
    return -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]


def test_ppl_matches_hand_computation(tiny_model):
    tokens = np.random.default_rng(0).integers(0, 256, size=3 * 80)
    rows = evaluate_ppl(tiny_model, tokens, lengths=[40, 80], samples=3, segment=4096)
    for row in rows:
        L = row["length"]
        windows = torch.from_numpy(tokens[: 3 * L].reshape(3, L))
        nll = torch.cat([_full_forward_nll(tiny_model, w[None]) for w in windows], dim=1)
        assert row["n"] == 3 and row["tokens"] == 3 * (L - 1)
        assert row["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)


@pytest.mark.parametrize(("segment", "length"), [(1, 40), (17, 200), (70, 200), (200, 200)])
def test_segment_wise_equals_full_forward(tiny_model, segment, length):
    ids = torch.randint(0, 256, (2, length))
    total, count = window_nll(tiny_model, ids, segment=segment, offload_mb=0 if segment == 70 else -1)
    reference = _full_forward_nll(tiny_model, ids)
    assert count == reference.numel()
    assert total == pytest.approx(reference.sum().item(), rel=1e-5)


def test_too_little_data_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="fewer than one window of length=512"):
        evaluate_ppl(tiny_model, np.zeros(300, dtype=np.int64), lengths=[64, 512], samples=1, segment=64)

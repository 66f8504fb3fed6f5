"""The ``gca`` lm-eval adapter scores exactly what lm-eval's stock ``hf`` model scores on the same export, for
loglikelihood requests that fit the stock model's length: contexts ending in spaces and newlines (lm-eval moves
that whitespace to the continuation), an empty context (the prefix token), and a context scored across many of
the adapter's stream segments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

REQUESTS = [
    ("The river is", " wide and calm."),
    ("The river is ", "wide and calm."),
    ("The river is   ", "wide"),
    ("Line one.\n", "Line two."),
    ("Line one.\n\n", "\tindented"),
    ("", "Old stone bridge."),
    ("A longer context that runs over several of the adapter's segments, " * 2, "and then ends."),
]


def test_adapter_matches_the_stock_hf_model(hf_export, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    from pipeline.evaluation.lm_eval_adapter import GCALM

    _, export = hf_export
    stock = HFLM(pretrained=str(export), trust_remote_code=True, device="cpu", batch_size=1, dtype="float32")
    ours = GCALM(checkpoint=str(export), segment=8)  # small segments: scoring crosses segment borders
    requests = [SimpleNamespace(args=pair) for pair in REQUESTS]
    assert ours.prefix_token_id == stock.prefix_token_id
    for context, continuation in REQUESTS:
        if context:
            assert ours._encode_pair(context, continuation) == stock._encode_pair(context, continuation)
    got = ours.loglikelihood(requests, disable_tqdm=True)
    want = stock.loglikelihood(requests, disable_tqdm=True)
    for pair, (score, greedy), (stock_score, stock_greedy) in zip(REQUESTS, got, want):
        assert score == pytest.approx(stock_score, rel=1e-4, abs=1e-4), pair
        assert greedy == stock_greedy, pair
    # The old rule (context and continuation encoded apart) differs on a context ending in a space: the test sees it.
    split_apart = ours.tok_encode("The river is ") + ours.tok_encode("wide and calm.")
    assert split_apart != sum(ours._encode_pair("The river is ", "wide and calm."), [])

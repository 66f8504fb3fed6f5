"""Perplexity by context on identical tokens, and whole-document perplexity: bookkeeping against a closed form on a
stub whose NLL depends only on how much context it has seen, and real models against one full forward."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import tiny_config

from model import build_model
from pipeline.evaluation import ppl
from pipeline.evaluation.ppl import context_ppl, document_ppl, window_nll
from pipeline.evaluation.runtime import StreamBudget

SPAN = 10_000
"""Token ``k * SPAN + i`` is position ``i`` of stub document ``k``: a token id names its document position."""


class ContextCounter(nn.Module):
    """Puts logit ``log(c)`` on the true next token (``id + 1``) and 0 on the rest, ``c`` being the tokens seen
    since the stream start: the next-token NLL is ``log((c + V - 1) / c)``, whatever the document.

    It follows the ``memory_only`` contract with ``window_reach``: logits closer than that to a ``memory_only``
    step are NaN (a harness that scores them fails), and it records the document positions of the targets of
    every logit row it returns, one set per stream.
    """

    vocab = 4 * SPAN
    window_reach = 5

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the harness a device
        self.streams: list[set[tuple[int, int]]] = []

    def new_stream_state(self, memory=None):
        self.streams.append(set())
        return SimpleNamespace(n_tokens=0, exact_from=0)

    def forward_stream(self, ids, state, last_logits=None, memory_only=False):
        T = ids.shape[1]
        start, state.n_tokens = state.n_tokens, state.n_tokens + T
        if memory_only:
            state.exact_from = state.n_tokens + self.window_reach - 1
            return torch.zeros(1, 0, self.vocab, dtype=torch.float64)
        keep = T if last_logits is None else min(last_logits, T)
        logits = torch.zeros(1, keep, self.vocab, dtype=torch.float64)  # fp64: the closed form holds to 1e-12
        for j in range(T - keep, T):
            token, seen = int(ids[0, j]), start + j + 1
            row = logits[0, j - (T - keep)]
            row[token + 1] = math.log(seen)
            if start + j < state.exact_from:
                row.fill_(math.nan)
            self.streams[-1].add(divmod(token + 1, SPAN))
        return logits


def _documents(*sizes):
    return [k * SPAN + np.arange(n, dtype=np.int64) for k, n in enumerate(sizes)]


def _closed_form_nll(length, score_len, vocab):
    """Targets at stream positions ``length - score_len .. length - 1`` have ``c`` = their position of context."""
    seen = np.arange(length - score_len, length, dtype=np.float64)
    return float(np.mean(np.log((seen + vocab - 1) / seen)))


@pytest.mark.parametrize("segment", [1, 3, 8, 1000])
def test_stub_nll_is_the_closed_form_of_the_context(segment):
    stub, score_len = ContextCounter(), 6
    rows = context_ppl(
        stub, _documents(90, 40, 120), lengths=[10, 40, 90], score_len=score_len, budget=StreamBudget(segment)
    )
    for row in rows:
        want = _closed_form_nll(row["length"], score_len, stub.vocab)
        assert row["kind"] == "context" and row["nll"] == pytest.approx(want, rel=1e-12)
        assert row["ppl"] == pytest.approx(math.exp(want), rel=1e-12)
        assert row["documents"] == 2 and row["tokens"] == 2 * score_len


@pytest.mark.parametrize("same_documents", [True, False])
def test_every_length_scores_the_final_tokens_of_each_document(same_documents):
    stub, score_len, sizes, lengths = ContextCounter(), 6, (90, 40, 120), [10, 40, 90]
    context_ppl(
        stub,
        _documents(*sizes),
        lengths=lengths,
        score_len=score_len,
        budget=StreamBudget(4),
        same_documents=same_documents,
    )
    expected = {k: {(k, i) for i in range(n - score_len, n)} for k, n in enumerate(sizes)}
    scored_docs = [k for length in lengths for k, n in enumerate(sizes) if n >= (90 if same_documents else length)]
    assert stub.streams == [expected[k] for k in scored_docs]


def test_document_counts_per_length():
    docs = _documents(90, 40, 120)
    same = context_ppl(ContextCounter(), docs, lengths=[10, 40, 90], score_len=6, budget=StreamBudget(16))
    each = context_ppl(
        ContextCounter(), docs, lengths=[10, 40, 90], score_len=6, budget=StreamBudget(16), same_documents=False
    )
    first = context_ppl(
        ContextCounter(),
        docs,
        lengths=[10, 40, 90],
        score_len=6,
        budget=StreamBudget(16),
        same_documents=False,
        samples=1,
    )
    assert [r["documents"] for r in same] == [2, 2, 2]
    assert [r["documents"] for r in each] == [3, 3, 2]
    assert [r["documents"] for r in first] == [1, 1, 1]


def test_different_positions_across_lengths_fail_loudly(monkeypatch):
    real = ppl.scored_tail_nll

    def shifted_at_40(model, document, *, length, **kwargs):
        nll, positions = real(model, document, length=length, **kwargs)
        return nll, range(positions.start - 1, positions.stop - 1) if length == 40 else positions

    monkeypatch.setattr(ppl, "scored_tail_nll", shifted_at_40)
    with pytest.raises(AssertionError, match="document 0: length=40 scored positions range"):
        context_ppl(ContextCounter(), _documents(90), lengths=[10, 40], score_len=6, budget=StreamBudget(16))


def test_lengths_no_document_holds_are_an_error_before_any_work():
    stub = ContextCounter()
    with pytest.raises(ValueError, match=r"length=500: no document holds 500 tokens \(the longest holds 120\)"):
        context_ppl(
            stub, _documents(90, 120), lengths=[10, 500], score_len=6, budget=StreamBudget(16), same_documents=False
        )
    with pytest.raises(ValueError, match="ppl_documents=windows"):
        context_ppl(stub, _documents(90, 120), lengths=[10, 500], score_len=6, budget=StreamBudget(16))
    assert stub.streams == []
    with pytest.raises(ValueError, match=r"lengths=\[6, 40\]: each must be > score_len=6"):
        context_ppl(stub, _documents(90), lengths=[6, 40], score_len=6, budget=StreamBudget(16))


def _reference_nll(model, document, length, score_len):
    """One whole forward over the last ``length`` tokens; cross-entropy of the last ``score_len`` targets."""
    ids = torch.from_numpy(document[len(document) - length :])[None]
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits[0, -score_len:].double(), ids[0, -score_len:], reduction="sum").item()


@pytest.mark.parametrize("arch", ["gca", "swa", "full"])
@pytest.mark.parametrize(("segment", "offload_mb"), [(7, -1), (64, 0), (4096, -1)])
def test_context_ppl_equals_one_full_forward(arch, segment, offload_mb):
    torch.manual_seed(0)
    model = build_model(tiny_config(arch=arch)).eval()  # window 32, reach 33 (gca): skips memory for L=300
    docs = [np.random.default_rng(k).integers(0, 256, size=n) for k, n in enumerate((300, 150, 400))]
    score_len, lengths = 24, [40, 100, 300]
    rows = context_ppl(
        model,
        docs,
        lengths=lengths,
        score_len=score_len,
        budget=StreamBudget(segment, offload_mb),
        same_documents=False,
    )
    for row in rows:
        long_enough = [d for d in docs if len(d) >= row["length"]]
        want = sum(_reference_nll(model, d, row["length"], score_len) for d in long_enough)
        assert row["documents"] == len(long_enough) and row["tokens"] == len(long_enough) * score_len
        assert row["nll"] == pytest.approx(want / row["tokens"], rel=1e-5)


def test_document_ppl_scores_every_position_of_each_document(tiny_model):
    docs = [np.random.default_rng(k).integers(0, 256, size=n) for k, n in enumerate((70, 1, 130))]
    row = document_ppl(tiny_model, docs, budget=StreamBudget(50))
    with torch.no_grad():
        nlls = [
            F.cross_entropy(tiny_model(torch.from_numpy(d)[None]).logits[0, :-1].double(), torch.from_numpy(d)[1:])
            for d in (docs[0], docs[2])
        ]
    want = (69 * nlls[0].item() + 129 * nlls[1].item()) / 198
    assert row["kind"] == "document" and row["documents"] == 2 and row["tokens"] == 198
    assert row["nll"] == pytest.approx(want, rel=1e-5) and row["ppl"] == pytest.approx(math.exp(want), rel=1e-5)


@pytest.mark.parametrize(("segment", "length"), [(1, 40), (17, 200), (70, 200), (200, 200)])
def test_segment_wise_equals_full_forward(tiny_model, segment, length):
    ids = torch.randint(0, 256, (2, length))
    total, count = window_nll(tiny_model, ids, budget=StreamBudget(segment, offload_mb=0 if segment == 70 else -1))
    with torch.no_grad():
        logits = tiny_model(ids).logits
    reference = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten(), reduction="sum")
    assert count == ids.shape[0] * (length - 1)
    assert total == pytest.approx(reference.item(), rel=1e-5)


def test_the_cli_scores_the_first_documents_long_enough(tmp_path):
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.haystack import TokenSource
    from pipeline.evaluation.run import ppl_documents
    from pipeline.evaluation.tokenizer import ByteTokenizer

    for name, size in (("a", 50), ("b", 300), ("c", 10), ("d", 200), ("e", 400)):
        (tmp_path / f"{name}.txt").write_text("x" * size)
    source = TokenSource(str(tmp_path), ByteTokenizer())  # no EOS: the stream is the 960 bytes
    assert [len(d) for d in ppl_documents(source, EvalConfig(lengths=[64, 200], samples=2))] == [300, 200]
    windows = ppl_documents(source, EvalConfig(lengths=[64, 200], samples=2, ppl_documents="windows"))
    assert [w.tolist() for w in windows] == [source.prefix(200).tolist(), source.prefix(400)[200:].tolist()]
    with pytest.raises(ValueError, match=r"length=500: no document holds 500 tokens \(the longest holds 400\)"):
        ppl_documents(source, EvalConfig(lengths=[64, 500]))
    with pytest.raises(ValueError, match="holds 960 tokens, fewer than one window of the longest length 1000"):
        ppl_documents(source, EvalConfig(lengths=[1000], ppl_documents="windows"))

"""Far recall in ``--task ppl``: each context row's far recall equals the one measured on the picks of a single whole
forward over the same window (the stream's ``memory_only`` prefix, deferred rows and segment cuts change nothing),
rows of models without retrieval hold none, and ``ppl.json`` carries the keys."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_config

from model import GCAForCausalLM, build_model, save_pretrained
from pipeline.evaluation.far_recall import FarRecall
from pipeline.evaluation.ppl import context_ppl
from pipeline.evaluation.runtime import StreamBudget

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"far_recall", "far_recall_random", "far_recall_tokens"}


def _whole_forward_far_recall(model: GCAForCausalLM, document: np.ndarray, length: int, score_len: int) -> FarRecall:
    """Far recall of the final ``score_len`` targets from one forward over the window's inputs (its tokens but the
    last, as the stream sees them)."""
    window = document[len(document) - length :]
    model.picks = {}
    with torch.no_grad():
        model(torch.from_numpy(window[:-1])[None])
    picks, model.picks = model.picks, None
    return FarRecall.measure(window, picks, model.cfg, scored=range(length - score_len, length))


@pytest.mark.parametrize(
    ("groups", "segment"), [([2], 5), ([2], 64), ([1, 1], 13)], ids=["one-group-5", "one-group-64", "two-groups-13"]
)
def test_context_rows_hold_the_whole_forwards_far_recall(groups, segment):
    torch.manual_seed(0)
    # Reach (1 + 2) * 4 = 12 tokens: a single-group stream skips the upper layers for most of each window.
    model = GCAForCausalLM(tiny_config(chunk_size=4, window=4, top_k=3, groups=groups)).eval()
    docs = [np.random.default_rng(k).integers(0, 3, size=n) for k, n in enumerate((300, 260))]
    score_len, lengths = 48, [120, 250]
    rows = context_ppl(model, docs, lengths=lengths, score_len=score_len, budget=StreamBudget(segment))
    for row in rows:
        want = sum(
            (_whole_forward_far_recall(model, d, row["length"], score_len) for d in docs),
            FarRecall.empty(len(groups)),
        )
        assert want.tokens > 30
        assert {k: row[k] for k in want.metrics()} == pytest.approx(want.metrics(), rel=1e-12)
    assert rows[0]["far_recall_random"] > rows[1]["far_recall_random"]  # more visible chunks, lower chance


def test_models_without_retrieval_have_no_far_recall():
    model = build_model(tiny_config(arch="swa")).eval()
    rows = context_ppl(model, [np.arange(200) % 7], lengths=[100], score_len=20, budget=StreamBudget(50))
    assert not KEYS & set(rows[0])


def test_ppl_json_holds_far_recall(tmp_path):
    torch.manual_seed(0)
    export = save_pretrained(GCAForCausalLM(tiny_config()).eval(), tmp_path / "export", extra={"train_seq_len": 128})
    spec = importlib.util.spec_from_file_location("launch_eval", ROOT / "launch" / "eval.py")
    assert spec is not None and spec.loader is not None
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    args = ["lengths=[512]", "score_len=128", "samples=2", "segment=100", "progress=false", "document_ppl=false"]
    assert launch.main(["--checkpoint", str(export), "--task", "ppl", "--out", str(tmp_path / "out"), *args]) == 0
    (row,) = json.loads((tmp_path / "out" / "ppl.json").read_text())["results"]
    assert KEYS <= set(row) and row["far_recall_tokens"] > 0
    assert 0 <= row["far_recall"] <= 1 and 0 < row["far_recall_random"] < 1

"""The lm-eval adapter: scores equal a hand computation; a local offline task runs end to end."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pipeline.evaluation.lm_eval_adapter import GCALM


@pytest.fixture
def lm(tiny_export):
    return GCALM(checkpoint=str(tiny_export), segment=7)  # tiny segments: scoring crosses segment borders


@pytest.mark.parametrize(("arg", "value"), [("segment", 0), ("max_gen_toks", -1), ("offload_mb", -2)])
def test_bad_model_args_are_refused_before_loading(tmp_path, arg, value):
    with pytest.raises(ValueError, match=rf"--model_args {arg}={value} must be >= "):
        GCALM(checkpoint=str(tmp_path / "no_export_here"), **{arg: value})  # loading it would fail differently


def _hand_logprob(model, ids, first):
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(first, len(ids)))


def test_loglikelihood_matches_full_forward(lm):
    req = SimpleNamespace(args=("The river is", " wide and calm."))
    ((score, greedy),) = lm.loglikelihood([req], disable_tqdm=True)
    ctx = list(b"The river is")  # lm-eval's split: no start token before a non-empty context
    ids = ctx + list(b" wide and calm.")
    assert score == pytest.approx(_hand_logprob(lm.model, ids, len(ctx)), rel=1e-5)
    assert greedy is False  # a random model does not argmax this continuation
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=("Old stone bridge.",))], disable_tqdm=True)
    assert rolling == pytest.approx(_hand_logprob(lm.model, [ord("\n")] + list(b"Old stone bridge."), 1), rel=1e-5)


def test_generate_until_stops(lm):
    (text,) = lm.generate_until(
        [SimpleNamespace(args=("Once", {"until": ["\n"], "max_gen_toks": 12}))], disable_tqdm=True
    )
    assert isinstance(text, str) and "\n" not in text and len(text.encode("utf-8", "replace")) <= 12 * 3


def test_local_task_through_simple_evaluate(tiny_export, tmp_path, monkeypatch):
    """``lm_eval`` end to end on a local multiple-choice task, with no network."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    rows = [{"q": f"Which is a color {i}?", "choices": ["green", "river", "walked"], "label": 0} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "toy_mc.yaml").write_text(
        "task: toy_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    out = lm_eval.simple_evaluate(
        model="gca",
        model_args=f"checkpoint={tiny_export}",
        tasks=["toy_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
    )
    acc = out["results"]["toy_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and not math.isnan(acc)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"

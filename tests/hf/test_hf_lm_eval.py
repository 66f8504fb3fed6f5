"""lm-eval's own CLI (``--model hf``, no wrapper) on the repository's local task, scoring with the native model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F

from pipeline.evaluation.lm_eval_task import DATA_FILE, write_recall_data

TASKS = Path(__file__).resolve().parents[2] / "configs" / "eval" / "lm_eval"


def _native_loglikelihood(model, sp, context: str, continuation: str) -> float:
    """lm-eval's ``hf`` scoring rule: trailing whitespace of the context moves to the continuation, the pair is
    encoded whole, and the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = sp.encode(context + continuation)
    n_context = len(sp.encode(context))
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].double(), -1)
    return sum(logp[t - 1, whole[t]].item() for t in range(n_context, len(whole)))


@pytest.mark.slow
def test_stock_lm_eval_cli_scores_the_local_task(hf_export, tmp_path):
    native, export = hf_export
    write_recall_data(tmp_path / DATA_FILE, n_docs=3, sentences=8)  # the task YAML reads it relative to the cwd
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    lm_eval = Path(sys.executable).with_name("lm_eval")
    command = [
        str(lm_eval),
        *("--model", "hf", "--model_args", f"pretrained={export},trust_remote_code=True"),
        *("--tasks", "gca_recall", "--include_path", str(TASKS), "--device", "cpu", "--batch_size", "4"),
        *("--limit", "3", "--output_path", str(tmp_path / "out"), "--log_samples"),
    ]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "gca_recall" in run.stdout and "acc" in run.stdout
    (samples,) = (tmp_path / "out").rglob("samples_gca_recall_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 3
    sp = spm.SentencePieceProcessor(model_file=str(export / "tokenizer.model"))
    for row in rows:
        requests = sorted(row["arguments"].items(), key=lambda item: int(item[0].rsplit("_", 1)[1]))
        for (_, args), (score, _) in zip(requests, row["filtered_resps"]):
            expected = _native_loglikelihood(native, sp, args["arg_0"], args["arg_1"])
            assert float(score) == pytest.approx(expected, rel=1e-5, abs=1e-3)

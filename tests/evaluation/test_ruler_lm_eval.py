"""Stock lm-eval's RULER generators on a tiny export with the network cut off: the ``hf`` model and the project's
streaming adapter (``--model gca``) run ``ruler_vt_offline`` and ``ruler_fwe_offline``
(``configs/eval/lm_eval/ruler_offline``) on the same documents; lm-eval's scores are RULER's string_match_all of
what each generated, and each one's generations are the native model's greedy continuations of its input."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from helpers import tiny_config
from transformers import AutoTokenizer

from data_prep.config import TokenizerConfig
from data_prep.tokenize import train_tokenizer
from model import GCAForCausalLM, save_pretrained
from pipeline.evaluation import ruler
from pipeline.evaluation.tokenizer import ModelTokenizer
from pipeline.hf import write_hf_files

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "configs" / "eval" / "lm_eval" / "ruler_offline"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
GUARD = """import socket

def _refuse(*args, **kwargs):
    raise OSError("network disabled by the test")

socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
"""
"""``sitecustomize.py``: every process of the test refuses to open a connection or resolve a name."""


def _export(directory: Path) -> tuple[GCAForCausalLM, Path]:
    """A random-init tiny model with a lossless BPE tokenizer (data prep's) that knows RULER's words well enough
    that lm-eval's variable-tracking generator finds room for its noise lines at 500 tokens."""
    from lm_eval.tasks.ruler import fwe_utils, vt_utils

    rng = random.Random(0)
    lines = [NOISE] * 50 + [vt_utils.TEMPLATE, fwe_utils.TEMPLATE] * 20
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for _ in range(200):
        lines.append(
            " ".join(f"VAR {''.join(rng.choices(letters, k=5))} = {rng.randint(10000, 99999)}" for _ in range(8))
        )
    tokenizer = train_tokenizer(lines, TokenizerConfig(vocab_size=600, model_type="bpe"), 1)
    directory.mkdir(parents=True)
    (directory / "tokenizer.model").write_bytes(tokenizer)
    vocab = spm.SentencePieceProcessor(model_proto=tokenizer).get_piece_size()
    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=vocab, chunk_size=8, window=16, gca_backend="matmul", swa_backend="sdpa", init_std=0.2
    )
    model = GCAForCausalLM(config).eval()
    save_pretrained(model, directory, extra={"seq_len": 64, "tokenizer": "tokenizer.model"})
    write_hf_files(directory)
    return model, directory


def _offline_env(tmp_path: Path) -> dict[str, str]:
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    env["HF_HOME"] = str(tmp_path / "hf_home")
    env["PYTHONPATH"] = os.pathsep.join([str(guard), str(REPO)])
    return env


def _samples(out: Path) -> dict[tuple[str, int], dict]:
    rows = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[task, row["doc_id"]] = row
    return rows


def _greedy(model: GCAForCausalLM, ids: list[int], n: int, eos: int | None) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
    return out


@pytest.mark.slow
def test_stock_lm_eval_ruler_tasks_run_offline_and_agree_with_the_adapter(tmp_path):
    model, export = _export(tmp_path / "export")
    env = _offline_env(tmp_path)
    probe = "import socket; socket.create_connection(('huggingface.co', 443))"
    blocked = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "network disabled by the test" in blocked.stderr

    tasks = "ruler_vt_offline,ruler_fwe_offline"
    common = ["--include_path", str(TASKS), "--tasks", tasks, "--limit", "2", "--log_samples"]
    metadata = {"max_seq_lengths": [2048], "tokenizer": str(export)}
    runs = {
        "hf": [
            str(Path(sys.executable).with_name("lm_eval")),
            *("--model", "hf", "--model_args", f"pretrained={export},trust_remote_code=True"),
            *("--device", "cpu", "--batch_size", "1"),
        ],
        "gca": [sys.executable, "-m", "pipeline.evaluation", "run", "--model", "gca"],
    }
    runs["gca"] += ["--model_args", f"checkpoint={export}"]
    samples = {}
    for name, command in runs.items():
        out = tmp_path / f"out_{name}"
        command = [*command, *common, "--metadata", json.dumps(metadata), "--output_path", str(out)]
        run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "ruler_vt_offline" in run.stdout and "ruler_fwe_offline" in run.stdout
        samples[name] = _samples(out)
        assert len(samples[name]) == 4  # 2 tasks x --limit 2

    tok = ModelTokenizer(export / "tokenizer.model")
    hf_tok = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    for key, hf in samples["hf"].items():
        gca = samples["gca"][key]
        # The same documents: lm-eval generated them from the export's tokenizer in both runs.
        assert gca["doc"]["input"] == hf["doc"]["input"] and gca["target"] == hf["target"]
        assert gca["arguments"] == hf["arguments"]
        for row in (hf, gca):  # lm-eval's score is RULER's string_match_all of what was generated
            prediction = ruler.postprocess(row["resps"][0][0])
            assert row["2048"] == pytest.approx(ruler.match_all(prediction, row["doc"]["outputs"]))
        # Both are the native model's greedy continuation of the same ids: the prompt without special tokens (it
        # fits the stock model's max_length of 2048 with the answer's room, so nothing is cut), the adapter streaming.
        args = gca["arguments"]["gen_args_0"]
        prompt, budget = tok.encode(args["arg_0"]), args["arg_1"]["max_gen_toks"]
        assert len(prompt) + budget <= 2048
        greedy = _greedy(model, prompt, budget, tok.eos_id)
        assert hf["resps"][0][0] == hf_tok.decode(greedy, skip_special_tokens=True)  # as lm-eval's hf model decodes
        assert gca["resps"][0][0] == tok.decode(greedy)  # the same ids (byte pieces render differently in hf)

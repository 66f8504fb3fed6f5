"""What a training run exports is a Hugging Face model folder: the trainer's final export and a checkpoint turned
into an export by `launch/export.py` load with transformers' Auto classes and give the native model's logits."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_prep import format as fmt
from data_prep.config import TokenizerConfig
from data_prep.tokenize import train_tokenizer
from model import load_pretrained
from pipeline.train.trainer import main

REPO = Path(__file__).resolve().parents[2]
TEXT = "def main(x):\n    return x + 1\n"


def _assert_hf_equals_native(export: Path) -> None:
    native = load_pretrained(export).eval()
    hf = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    reference = spm.SentencePieceProcessor(model_proto=(export / "tokenizer.model").read_bytes())
    ids = tokenizer(TEXT).input_ids
    assert ids == reference.encode(TEXT) and tokenizer.decode(ids) == TEXT
    x = torch.tensor([ids * 6])  # longer than train.seq_len=64 and not a multiple of the chunk size
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, native(x).logits, rtol=0, atol=1e-5)


def _with_prep_tokenizer(tiny_data: Path, directory: Path) -> Path:
    """``tiny_data``'s splits with a tokenizer trained the way ``make prep`` trains one (lossless, byte fallback:
    its pieces outnumber the tiny model's 64 ids, so the model's vocabulary grows to hold them)."""
    shutil.copytree(tiny_data, directory)
    rng = random.Random(0)
    words = "the river runs past old stone walls where green moss grows def return".split()
    texts = [" ".join(rng.choice(words) for _ in range(40)) + "\n" for _ in range(200)]
    model = train_tokenizer(texts, TokenizerConfig(vocab_size=320, model_type="bpe"), num_threads=1)
    (directory / fmt.TOKENIZER_FILENAME).write_bytes(model)
    return directory


def test_the_trainers_export_and_an_exported_checkpoint_load_in_transformers(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    data = _with_prep_tokenizer(tiny_data, tmp_path / "data")
    settings = {"train.max_steps": 4, "checkpoint.every": 2, "model.vocab_size": 320}
    assert main(None, overrides(run, data, **settings)) == 0
    _assert_hf_equals_native(run / "export")

    out = tmp_path / "step2_export"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/export.py"),
            "--checkpoint",
            str(run / "checkpoints/step_00000002"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    _assert_hf_equals_native(out)
    step2 = load_pretrained(out).state_dict()
    final = load_pretrained(run / "export").state_dict()
    assert any(not torch.equal(step2[k], final[k]) for k in final), "step 2's weights, not the final ones"

"""``launch/convert.py``: a dense transformers checkpoint becomes a GCA export that loads natively and in
transformers with the dense model's in-window logits, carrying the folder's SentencePiece tokenizer."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_prep import format as fmt
from model import load_pretrained
from pipeline.cli.convert import main

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
LAYOUT = ["model.n_lower_layers=1", "model.groups=[1]", "model.chunk_size=8", "model.top_k=2", "model.window=80"]


def convert(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "launch/convert.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_the_converted_export_loads_natively_and_in_transformers(tmp_path, tiny_data, capsys):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config).eval()
    dense.save_pretrained(tmp_path / "dense")
    tokenizer = (tiny_data / fmt.TOKENIZER_FILENAME).read_bytes()
    (tmp_path / "dense" / "tokenizer.model").write_bytes(tokenizer)
    done = convert("--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "gca"), *LAYOUT)
    assert done.returncode == 0, done.stderr
    ids = torch.randint(0, 64, (1, 70))  # 70 tokens + 8 landmarks <= window 80
    native = load_pretrained(tmp_path / "gca")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gca", trust_remote_code=True).eval()
    with torch.no_grad():
        want = dense(ids).logits
        torch.testing.assert_close(native(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(hf(ids).logits, want, rtol=0, atol=1e-5)
    assert (tmp_path / "gca" / "tokenizer.model").read_bytes() == tokenizer
    # A second conversion into the same directory, or a key GCAConfig does not have: exit 2, one line, nothing written.
    assert main(["--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "gca"), *LAYOUT]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "bad"), "model.windows=8"]) == 2
    err = capsys.readouterr().err
    assert "model.windows" in err and err.count("\n") == 1
    assert main(["--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "bad"), "model.d_model=64"]) == 2
    assert "model.d_model comes from the dense checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()

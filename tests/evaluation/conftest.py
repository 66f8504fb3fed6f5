"""Tiny models and exports for the evaluation tests (naive backend, CPU, a few seconds each)."""

import pytest
import torch
from helpers import tiny_config

from model import GCAForCausalLM, save_pretrained


@pytest.fixture
def tiny_model() -> GCAForCausalLM:
    torch.manual_seed(0)
    return GCAForCausalLM(tiny_config()).eval()


@pytest.fixture
def tiny_export(tmp_path, tiny_model):
    """A synthetic-vocab export (no tokenizer: the byte tokenizer is used)."""
    return save_pretrained(tiny_model, tmp_path / "export", extra={"train_seq_len": 128})


@pytest.fixture(scope="session")
def sp_eval_outputs(tmp_path_factory):
    """``(export, out)``: a tiny random GCA export with a SentencePiece tokenizer of its whole vocabulary (so every
    id it predicts decodes), and ``out`` holding what ``launch/eval.py`` wrote for ppl, passkey and ruler on it
    (every task into the one ``--out``). Shared by the tests that read eval outputs; they copy ``out`` before
    writing into it."""
    import sentencepiece as spm
    from helpers import train_test_tokenizer

    from pipeline.cli.eval import main
    from pipeline.evaluation.haystack import WORDS

    root = tmp_path_factory.mktemp("sp_eval")
    lines = [f"The pass key is {i * 7919 % 100000}. " + " ".join(WORDS[i % 50 : i % 50 + 12]) for i in range(400)]
    model_bytes = train_test_tokenizer(lines, 320, byte_fallback=True)
    vocab = spm.SentencePieceProcessor(model_proto=model_bytes).get_piece_size()
    torch.manual_seed(0)
    export = save_pretrained(
        GCAForCausalLM(tiny_config(vocab_size=vocab)).eval(),
        root / "export",
        extra={"train_seq_len": 128, "tokenizer": "tokenizer.model"},
    )
    (export / "tokenizer.model").write_bytes(model_bytes)
    out = root / "out"
    common = ["segment=128", "progress=false", "samples=2"]
    tasks = {
        "ppl": ["lengths=[256,512]", "score_len=64"],
        "passkey": ["lengths=[256,512]", "depths=[0,1]"],
        "ruler": ["lengths=[512]", "ruler_tasks=[niah_single_2,niah_multivalue]"],
    }
    for task, keys in tasks.items():
        assert main(["--checkpoint", str(export), "--out", str(out), "--task", task, *common, *keys]) == 0, task
    return export, out

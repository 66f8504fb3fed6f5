"""The export's SentencePiece tokenizer is used when named; otherwise bytes; mismatches are errors."""

import io

import numpy as np
import pytest
import sentencepiece as spm

from model import save_pretrained
from pipeline.data.needle import NeedleSpec
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import build_sample
from pipeline.evaluation.runtime import load_checkpoint
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer


@pytest.fixture
def sp_export(tmp_path):
    from helpers import tiny_config

    from model import GCAForCausalLM

    lines = [
        f"The pass key is {i * 7919 % 100000}. Remember it. The river walked over the old bridge." for i in range(300)
    ]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        num_threads=1,
    )
    model_512 = GCAForCausalLM(tiny_config(vocab_size=512))
    export = save_pretrained(model_512, tmp_path / "export", extra={"tokenizer": "tokenizer.model"})
    (export / "tokenizer.model").write_bytes(model.getvalue())
    return export


def test_sentencepiece_needle(sp_export):
    ckpt = load_checkpoint(sp_export)
    assert isinstance(ckpt.tokenizer, ModelTokenizer)
    source = TokenSource("builtin", ckpt.tokenizer)
    sample = build_sample(
        source, ckpt.tokenizer, NeedleSpec("single"), length=600, depth=0.5, rng=np.random.default_rng(0), chunk_size=16
    )
    answer = sample.ids[sample.answer_start : sample.answer_start + sample.answer_len].tolist()
    assert ckpt.tokenizer.decode(answer).strip() == sample.key
    assert ckpt.tokenizer.decode(answer[:1]).strip()  # a whitespace-only first piece moved into the question
    assert ckpt.tokenizer.decode(sample.ids[: sample.answer_start].tolist()).rstrip().endswith("The pass key is")


def test_missing_tokenizer_file(tiny_model, tmp_path):
    export = save_pretrained(tiny_model, tmp_path / "e", extra={"tokenizer": "tokenizer.model"})
    with pytest.raises(FileNotFoundError, match="export.tokenizer='tokenizer.model' but .* does not exist"):
        load_checkpoint(export)


def test_bytes_need_256_ids(tmp_path):
    from helpers import tiny_config

    from model import GCAForCausalLM

    export = save_pretrained(GCAForCausalLM(tiny_config(vocab_size=100)), tmp_path / "e")
    with pytest.raises(ValueError, match="has 256 ids but the model's vocab_size is 100"):
        load_checkpoint(export)
    assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"

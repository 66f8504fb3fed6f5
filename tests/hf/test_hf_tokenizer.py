"""``AutoTokenizer`` on an export encodes and decodes exactly like the SentencePiece model the data was made with."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
from hf_export_helpers import hf_model_config, sample_texts, trained_tokenizer
from transformers import AutoTokenizer

from pipeline.hf.tokenizer import write_tokenizer_files

EDGE_CASES = (
    "",
    " ",
    "  two leading spaces",
    "trailing spaces  ",
    "\n",
    "\t\ttabs",
    "unseen ☃ ƒ ж 😀 characters",
    "digits 0123456789 and 3.14159",
    "\n\nblank lines\n\n\n",
)


def _written(model: bytes, directory: Path) -> Path:
    write_tokenizer_files(directory, model)
    return directory


@pytest.fixture(scope="module", params=[("bpe", 400), ("unigram", 340)], ids=["bpe", "unigram"])
def tokenizers(request, tmp_path_factory):
    model = trained_tokenizer(*request.param)
    directory = _written(model, tmp_path_factory.mktemp(request.param[0]))
    return spm.SentencePieceProcessor(model_proto=model), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("text", [*EDGE_CASES, *sample_texts(20, seed=7)])
def test_encode_and_decode_equal_sentencepiece(tokenizers, text):
    sp, tok = tokenizers
    ids = sp.encode(text)
    assert tok.encode(text) == ids
    assert tok(text)["input_ids"] == ids  # the call lm-eval and pipelines make
    assert tok.decode(ids) == sp.decode(ids) == text


def test_bpe_encodes_literal_special_token_text_as_text(bpe_tokenizer, tmp_path):
    """SentencePiece reads ``</s>`` typed in a text as characters; so does the exported BPE tokenizer (data prep's
    default model type; the unigram conversion is exact except on such text, see ``pipeline.hf.tokenizer``)."""
    sp = spm.SentencePieceProcessor(model_proto=bpe_tokenizer)
    tok = AutoTokenizer.from_pretrained(_written(bpe_tokenizer, tmp_path))
    text = "literal </s> and <s> and <unk> and <0x41> markup"
    assert tok.encode(text) == sp.encode(text) and sp.eos_id() not in sp.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_sentencepiece_ids(tokenizers):
    sp, tok = tokenizers
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (sp.unk_id(), sp.bos_id(), sp.eos_id())
    assert tok.decode([sp.eos_id()], skip_special_tokens=True) == ""


def test_a_normalising_tokenizer_gets_no_files_but_the_model_still_exports(tmp_path, caplog):
    """A SentencePiece model data prep would not train (dummy prefix, NFKC) cannot be reproduced exactly: the export
    gets the model files and a warning, never a tokenizer that encodes differently."""
    import io

    from model import GCAForCausalLM, save_pretrained
    from pipeline.hf import write_hf_files

    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_texts(200, seed=3)), model_writer=writer, vocab_size=150, minloglevel=2
    )
    directory = tmp_path / "export"
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(writer.getvalue())
    save_pretrained(GCAForCausalLM(hf_model_config(300)), directory, extra={"tokenizer": "tokenizer.model"})
    write_hf_files(directory)
    assert "no Hugging Face tokenizer files" in caplog.text
    assert (directory / "modeling_gca.py").is_file() and not (directory / "tokenizer.json").exists()


def test_a_named_but_missing_tokenizer_is_a_warning(tmp_path, caplog):
    """The trainer names ``tokenizer.model`` even when the dataset had none to copy: the export still gets its model
    files."""
    from model import GCAForCausalLM, save_pretrained
    from pipeline.hf import write_hf_files

    directory = save_pretrained(
        GCAForCausalLM(hf_model_config(300)), tmp_path / "x", extra={"tokenizer": "tokenizer.model"}
    )
    write_hf_files(directory)
    assert "which is missing" in caplog.text and (directory / "modeling_gca.py").is_file()

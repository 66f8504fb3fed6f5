"""``tokenizer.type=hf tokenizer.path=<dir>``: prep tokenizes with a Hugging Face ``tokenizer.json`` (built here with
the ``tokenizers`` library, offline), and its ids equal that library's own whole-document encode."""

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from helpers import HF_SPECIALS, hf_test_tokenizer, save_hf_tokenizer
from tokenizers import Tokenizer

from data_prep import tokenize
from data_prep.config import load_config
from data_prep.errors import ConfigError
from data_prep.format import SPLITS, read_manifest
from data_prep.hf_tokenizer import segment_safe

CONFIG = {"eos_token": "<|end_of_text|>", "bos_token": {"content": "<|begin_of_text|>"}, "tokenizer_class": "X"}


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    return corpus[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, texts) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {
        "llama3": save_hf_tokenizer(root / "llama3", hf_test_tokenizer(texts, 600, "llama3"), CONFIG),
        "qwen2": save_hf_tokenizer(root / "qwen2", hf_test_tokenizer(texts, 600, "qwen2")),  # specials by name
        "llama2": save_hf_tokenizer(root / "llama2", hf_test_tokenizer(texts, 400, "llama2")),
    }


def stored_documents(out: Path, read_split, join_documents) -> list[tuple[int, ...]]:
    docs: list[tuple[int, ...]] = []
    for split in SPLITS:
        docs += [tuple(ids) for ids in join_documents(read_split(out / split)).values()]
    return docs


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "llama2"])
def test_prep_ids_equal_the_tokenizers_whole_document_encode(
    kind, folders, texts, run_prep, read_split, join_documents, tmp_path, monkeypatch
):
    """Segments of 256 characters (every document is cut many times where the tokenizer allows it, and a run of
    1000 CJK characters has no safe point), against ``Tokenizer.encode`` of each whole document."""
    monkeypatch.setattr(tokenize, "SEGMENT_CHARS", 256)
    cjk = "北京東京" * 250 + " end " + "字" * 300
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate([*texts, cjk]):
        (corpus / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    manifest = run_prep(inputs=[str(corpus)], **{"tokenizer.type": "hf", "tokenizer.path": folders[kind]})
    reference = Tokenizer.from_file(str(folders[kind] / "tokenizer.json"))
    want = Counter(tuple(reference.encode(t, add_special_tokens=False).ids) for t in [*texts, cjk])
    assert Counter(stored_documents(tmp_path / "out", read_split, join_documents)) == want
    out = tmp_path / "out"
    data = (folders[kind] / "tokenizer.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == data and not (out / "tokenizer.model").exists()
    info = manifest.tokenizer
    assert (info.type, info.sha256, info.model_type, info.trained) == (
        "hf",
        hashlib.sha256(data).hexdigest(),
        "bpe",
        False,
    )
    assert info.vocab_size == reference.get_vocab_size(with_added_tokens=True) and manifest.token_dtype == "uint16"
    assert read_manifest(out) == manifest and manifest.software["tokenizers"]
    if kind == "llama3":  # the config names them
        assert (out / "tokenizer_config.json").read_bytes() == (folders[kind] / "tokenizer_config.json").read_bytes()
        assert info.config_sha256 == hashlib.sha256((out / "tokenizer_config.json").read_bytes()).hexdigest()
        assert (info.eos_id, info.bos_id) == (0, 1)
    elif kind == "qwen2":  # no config: the special added tokens by their usual names
        assert not (out / "tokenizer_config.json").exists() and info.config_sha256 == ""
        assert (info.eos_id, info.bos_id, info.pad_id) == (HF_SPECIALS.index("<|end_of_text|>"), 1, -1)
    else:
        assert (info.unk_id, info.bos_id, info.eos_id) == (0, 1, 2)


def test_which_tokenizers_are_encoded_in_segments(folders, texts):
    """Byte-level BPE layouts (Llama-3, Qwen2) are cut; a Llama-2 style one is not, and it would differ if it were:
    every encode call prepends a ``▁``."""
    layouts = {kind: json.loads((folder / "tokenizer.json").read_text()) for kind, folder in folders.items()}
    assert segment_safe(layouts["llama3"]) is None and segment_safe(layouts["qwen2"]) is None
    assert "normalizer Sequence" in str(segment_safe(layouts["llama2"]))
    prefixed = json.loads(json.dumps(layouts["llama3"]))
    prefixed["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    assert segment_safe(prefixed) is not None
    text = max(texts, key=len)
    llama2 = Tokenizer.from_file(str(folders["llama2"] / "tokenizer.json"))
    parts = tokenize.segments(text, 256)
    assert len(parts) > 2
    cut = [i for part in parts for i in llama2.encode(part, add_special_tokens=False).ids]
    assert cut != llama2.encode(text, add_special_tokens=False).ids
    assert tokenize.segmenter((folders["llama2"] / "tokenizer.json").read_bytes())(text) == [text]


def test_round_trip_is_exact_for_byte_level_bpe_but_not_through_a_normalizer(folders):
    text = "café  naïve\tdouble  spaces\n\n北京 🙂 <s>"
    decomposed = "cafe\u0301"  # "café" with a combining accent: NFC composes it
    for kind in ("llama3", "qwen2"):
        tok = Tokenizer.from_file(str(folders[kind] / "tokenizer.json"))
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    llama3 = Tokenizer.from_file(str(folders["llama3"] / "tokenizer.json"))
    qwen2 = Tokenizer.from_file(str(folders["qwen2"] / "tokenizer.json"))
    assert llama3.decode(llama3.encode(decomposed).ids) == decomposed
    assert qwen2.decode(qwen2.encode(decomposed).ids) == "café" != decomposed


def test_special_token_text_in_a_document_encodes_as_the_special_id(folders):
    """``tokenizers`` matches added tokens in the text even without ``add_special_tokens``, as prep's reference does."""
    tok = Tokenizer.from_file(str(folders["llama3"] / "tokenizer.json"))
    assert tok.encode("a<|end_of_text|>b", add_special_tokens=False).ids.count(0) == 1


def config_error(tmp_path: Path, *dotlist: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"output={tmp_path / 'out'}", "input=x.txt", *dotlist])
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_hf_tokenizer_settings_are_one_line_errors_naming_the_key(folders, tmp_path):
    good = folders["llama3"]
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": ')
    wrong_eos = save_hf_tokenizer(
        tmp_path / "wrong_eos", Tokenizer.from_file(str(good / "tokenizer.json")), {"eos_token": "<nope>"}
    )
    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    (bad_config / "tokenizer.json").write_bytes((good / "tokenizer.json").read_bytes())
    (bad_config / "tokenizer_config.json").write_text("[1, 2]")
    cases = {
        ("tokenizer.type=hf",): "tokenizer.type=hf needs tokenizer.path",
        ("tokenizer.type=hf", f"tokenizer.path={tmp_path / 'missing'}"): "tokenizer.path=.*is not a directory",
        ("tokenizer.type=hf", f"tokenizer.path={empty}"): "tokenizer.path=.*holds no tokenizer.json",
        ("tokenizer.type=hf", f"tokenizer.path={broken}"): "tokenizer.path=.*is not a readable tokenizer.json",
        ("tokenizer.type=hf", f"tokenizer.path={wrong_eos}"): "tokenizer.path=.*eos_token='<nope>' is not a token",
        ("tokenizer.type=hf", f"tokenizer.path={bad_config}"): "tokenizer.path=.*tokenizer_config.json is not a JSON",
        ("tokenizer.type=hf", f"tokenizer.path={good}", "tokenizer.vocab_size=500"): "tokenizer.vocab_size=500 cannot",
        ("tokenizer.type=hf", f"tokenizer.path={good}", "tokenizer.model=x.model"): "tokenizer.model='x.model' cannot",
        (f"tokenizer.path={good}", "tokenizer.vocab_size=500"): "tokenizer.path=.*only with tokenizer.type=hf",
        ("tokenizer.type=tiktoken",): "tokenizer.type",
    }
    import re

    for dotlist, pattern in cases.items():
        assert re.search(pattern, config_error(tmp_path, *dotlist)), (dotlist, pattern)


@pytest.mark.parametrize("choice", ["sentencepiece_model", "hf_folder"])
def test_a_command_line_tokenizer_over_a_config_files_vocab_size_names_the_way_out(choice, folders, tmp_path):
    """The config file trains a tokenizer (``tokenizer.vocab_size``); the command line names one to use instead.
    The refusal says how to lift the file's key, and doing what it says loads."""
    config = tmp_path / "prep.yaml"
    config.write_text(f"input: x.txt\noutput: {tmp_path / 'out'}\ntokenizer:\n  vocab_size: 4096\n")
    model = tmp_path / "existing.model"
    model.write_bytes(b"")  # only its existence is checked before work
    folder = folders["llama3"]
    chosen = (
        [f"tokenizer.model={model}"]
        if choice == "sentencepiece_model"
        else ["tokenizer.type=hf", f"tokenizer.path={folder}"]
    )
    with pytest.raises(ConfigError) as err:
        load_config(config, chosen)
    assert "add tokenizer.vocab_size=null" in str(err.value) and "\n" not in str(err.value), err.value
    tok = load_config(config, [*chosen, "tokenizer.vocab_size=null"]).tokenizer
    assert tok.vocab_size is None
    assert (tok.model, tok.path) == ((str(model), None) if choice == "sentencepiece_model" else (None, str(folder)))


def test_an_hf_dataset_is_replaced_with_overwrite(folders, run_prep, tmp_path):
    hf = {"tokenizer.type": "hf", "tokenizer.path": folders["llama3"]}
    first = run_prep(**hf)
    second = run_prep(overwrite="true", **hf)
    assert first.splits == second.splits and (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_an_output_holding_the_tokenizer_folder_is_refused(folders, run_prep, tmp_path):
    inside = save_hf_tokenizer(tmp_path / "out" / "tok", hf_test_tokenizer(["a b c"] * 10, 300))
    with pytest.raises(ConfigError, match="contains tokenizer.path="):
        run_prep(**{"tokenizer.type": "hf", "tokenizer.path": inside, "overwrite": "true"})


def test_a_long_document_is_one_encode_call_for_a_llama2_style_tokenizer(folders, run_prep, tmp_path, monkeypatch):
    """The fallback keeps every id right and the document whole (no segment is ever cut for it)."""
    monkeypatch.setattr(tokenize, "SEGMENT_CHARS", 64)
    rng = random.Random(1)
    text = " ".join(rng.choice(["alpha", "beta", "  gamma", "delta\n"]) for _ in range(400))
    (tmp_path / "doc.txt").write_text(text)
    manifest = run_prep(
        inputs=[str(tmp_path / "doc.txt")],
        val_fraction=0,
        **{"tokenizer.type": "hf", "tokenizer.path": folders["llama2"]},
    )
    tok = Tokenizer.from_file(str(folders["llama2"] / "tokenizer.json"))
    assert manifest.splits["train"].tokens == len(tok.encode(text, add_special_tokens=False).ids)

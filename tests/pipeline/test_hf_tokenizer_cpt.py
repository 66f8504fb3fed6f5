"""Continued pretraining on a dense model's own Hugging Face tokenizer: prep with ``tokenizer.type=hf``, train a
converted Llama with ``checkpoint.init_from=hf:<dir>``, and the exports, the eval jobs and generation use that
``tokenizer.json``; a dataset made with another tokenizer is refused."""

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import hf_test_tokenizer, save_hf_tokenizer, save_tiny_dense
from tokenizers import Tokenizer

from data_prep.config import load_config as load_prep_config
from data_prep.shard import main as prep
from pipeline.evaluation.runtime import load_checkpoint
from pipeline.train.config import ConfigError, load_config
from pipeline.train.inputs import check_inputs
from pipeline.train.trainer import main

transformers = pytest.importorskip("transformers")

VOCAB = 300
"""The byte-level BPE's 256 bytes, 2 special tokens and a few merges; the dense model's ``vocab_size``."""
STAGE = {
    "model.vocab_size": VOCAB,
    "model.position": "rope",
    "model.tokens_see_landmarks": False,
    "model.norm_eps": 1e-6,
    "model.rope_theta": 10000.0,
    "train.max_steps": 3,
}
"""What the dense checkpoint below dictates (as in test_convert_train.py), on top of the tests' tiny model."""
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
}
PROBE = "The pass key is 48213. Remember it.  Café 北京\tdone"


def sample_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the river ran past old mills while a train crossed the valley pass key is remember it 12 345".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(80, 200))) + "." for _ in range(n)]


def dense_folder(folder: Path, kind: str) -> Path:
    """A random 2-layer ``LlamaForCausalLM`` (``llama3``) or ``Qwen2ForCausalLM`` (``qwen2``) of the tiny trainer
    model's shapes, with a byte-level BPE ``tokenizer.json`` of that model family's layout."""
    save_hf_tokenizer(folder, hf_test_tokenizer(sample_texts(200, 0), VOCAB, kind), TOKENIZER_CONFIG)
    return save_tiny_dense(folder, vocab_size=VOCAB, kind="qwen2" if kind == "qwen2" else "llama")


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return dense_folder(tmp_path_factory.mktemp("dense") / "llama3", "llama3")


def prepared(root: Path, tokenizer: Path, name: str) -> Path:
    corpus = root / f"{name}_corpus"
    corpus.mkdir()
    for i, text in enumerate(sample_texts(40, 1)):
        (corpus / f"{i:02d}.txt").write_text(text)
    dotlist = [f"output={root / name}", f"input={corpus}", "tokenizer.type=hf", f"tokenizer.path={tokenizer}"]
    # whole val documents: the ppl check below needs one of 128 tokens (val_unit=auto would hold out short tails)
    prep(load_prep_config(None, [*dotlist, "val_fraction=0.1", "val_unit=documents", "progress=false"]))
    return root / name


@pytest.fixture(scope="module")
def data(tmp_path_factory, dense) -> Path:
    return prepared(tmp_path_factory.mktemp("data"), dense, "hf_data")


def stage(dense: Path) -> dict:
    return {**STAGE, "checkpoint.init_from": f"hf:{dense}", "model.qkv_bias": dense.name == "qwen2"}


MONITOR = {
    "eval.extrapolation_every": 3,
    "eval.extrapolation_lengths": "[1,2]",
    "eval.extrapolation_samples": 1,
    "eval.extrapolation_score_len": 16,
}
"""The extrapolation monitor at the last step: its passkey probe writes its needle with the dataset's tokenizer."""


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_a_converted_model_trains_on_its_own_hf_tokenizer_and_its_exports_carry_it(
    kind, tmp_path, data, dense, overrides, capfd
):
    if kind == "qwen2":  # Qwen2's layout: single-digit pre-tokens, an NFC normalizer, q/k/v biases
        dense = dense_folder(tmp_path / "qwen2", "qwen2")
        data = prepared(tmp_path, dense, "qwen2_data")
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **stage(dense), **{"optim.trainable": "new"}, **MONITOR)) == 0
    probed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("extrap/passkey@64" in record for record in probed)  # 1x train.seq_len
    export = run / "export"
    reference = Tokenizer.from_file(str(dense / "tokenizer.json"))
    want = reference.encode(PROBE, add_special_tokens=False).ids
    assert (export / "tokenizer.json").read_bytes() == (dense / "tokenizer.json").read_bytes()
    config = json.loads((export / "config.json").read_text())
    assert config["export"]["tokenizer"] == "tokenizer.json" and not (export / "tokenizer.model").exists()
    assert (config["eos_token_id"], config["bos_token_id"]) == (0, 1)

    native = load_checkpoint(export).tokenizer  # the eval jobs' and generation's tokenizer
    assert native.encode(PROBE) == want and native.decode(want) == PROBE and native.eos_id == 0

    hf = transformers.AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    source = transformers.AutoTokenizer.from_pretrained(dense)
    assert hf(PROBE, add_special_tokens=False)["input_ids"] == want
    assert hf(PROBE)["input_ids"] == source(PROBE)["input_ids"]  # the same post-processor
    assert (hf.eos_token, hf.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")
    assert hf.decode(want) == PROBE

    from pipeline.cli.eval import main as eval_main
    from pipeline.cli.generate import main as generate_main

    def evaluate(task: str, *overrides: str) -> int:
        out = ["--out", str(tmp_path / "eval"), "--task", task]
        return eval_main(["--checkpoint", str(export), *out, "progress=false", *overrides])

    assert evaluate("passkey", "lengths=[256]", "samples=1", "depths=[0.5]") == 0
    assert evaluate("ppl", "lengths=[128]", "score_len=32", f"data={data}") == 0
    assert evaluate("ruler", "lengths=[256]", "samples=1", "ruler_tasks=[niah_single_1]") == 0
    assert generate_main(["--checkpoint", str(export), "--prompt", "the river", "--max-new-tokens", "4"]) == 0
    assert "tokenizer.json" in capfd.readouterr().err  # each job logged the export's tokenizer it loaded


def test_a_dataset_made_with_another_tokenizer_than_the_dense_models_is_refused(
    tmp_path, data, dense, overrides, tiny_data
):
    other = save_hf_tokenizer(tmp_path / "other", hf_test_tokenizer(sample_texts(200, 5), VOCAB, "qwen2"))
    theirs = prepared(tmp_path, other, "other_data")

    def check(dataset: Path, folder: Path) -> None:
        check_inputs(load_config(None, overrides(tmp_path / "run", dataset, **stage(folder))))

    check(data, dense)  # the dense model's own tokenizer.json: accepted
    with pytest.raises(ConfigError) as err:
        check(theirs, dense)
    message = str(err.value)
    assert "\n" not in message
    assert "(tokenizer.json, sha256 " in message and f"tokenizer.type=hf tokenizer.path={dense}" in message
    ours_sha = json.loads((theirs / "manifest.json").read_text())["tokenizer"]["sha256"][:12]
    assert ours_sha in message
    with pytest.raises(ConfigError, match=f"tokenizer.type=hf tokenizer.path={dense}"):
        check(tiny_data, dense)  # a SentencePiece dataset for a tokenizer.json-only model
    sentencepiece_only = tmp_path / "sp_dense"
    shutil.copytree(dense, sentencepiece_only)
    (sentencepiece_only / "tokenizer.json").unlink()
    (sentencepiece_only / "tokenizer.model").write_bytes((tiny_data / "tokenizer.model").read_bytes())
    with pytest.raises(ConfigError, match=r"tokenizer\.model=.*sp_dense/tokenizer\.model"):
        check(data, sentencepiece_only)  # an HF dataset for a SentencePiece model


def test_launch_convert_carries_the_dense_models_tokenizer_json(tmp_path, dense):
    from pipeline.cli.convert import main as convert

    out = tmp_path / "converted"
    layout = ["model.n_lower_layers=1", "model.groups=[1]", "model.chunk_size=8", "model.window=16", "model.top_k=2"]
    assert convert(["--dense", str(dense), "--out", str(out), *layout]) == 0
    assert (out / "tokenizer.json").read_bytes() == (dense / "tokenizer.json").read_bytes()
    want = Tokenizer.from_file(str(dense / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    assert load_checkpoint(out).tokenizer.encode(PROBE) == want
    assert transformers.AutoTokenizer.from_pretrained(out)(PROBE, add_special_tokens=False)["input_ids"] == want

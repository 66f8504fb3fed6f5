"""``export_checkpoint``: a committed training checkpoint becomes an export both loaders read."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from hf_export_helpers import hf_model_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from model import GCAForCausalLM, load_pretrained, save_pretrained
from pipeline.train.checkpoint import (
    COMMIT_MARKER,
    TRAINER_STATE,
    CheckpointCorruptError,
    CheckpointError,
    write_integrity,
)
from pipeline.train.export import _ONE_PROCESS, export_checkpoint


def _checkpoint(tmp_path, tokenizer: bytes, with_export: bool):
    """A checkpoint laid out as the trainer's single-process save: engine ``state.pt``, trainer state with the
    model config, the config text and the data fingerprint, optionally the eval export, then manifest and marker."""
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_proto=tokenizer).get_piece_size()
    torch.manual_seed(1)
    model = GCAForCausalLM(hf_model_config(vocab)).eval()
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.model").write_bytes(tokenizer)
    step = tmp_path / "run" / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    wrapped = {k.replace("lower.0.", "lower.0._checkpoint_wrapped_module."): v for k, v in model.state_dict().items()}
    torch.save({"model": wrapped, "optim": {}}, step / "state.pt")
    state = {
        "format": 2,
        "step": 10,
        "model_config": model.cfg.to_dict(),
        "config_yaml": f"data:\n  path: {data}\ntrain:\n  seq_len: 64\n",
        "data_fingerprint": {"tokenizer_sha256": hashlib.sha256(tokenizer).hexdigest()},
    }
    (step / TRAINER_STATE).write_text(json.dumps(state))
    if with_export:
        (step / "export").mkdir()
        (step / "export" / "tokenizer.model").write_bytes(tokenizer)
        save_pretrained(model, step / "export", extra={"step": 10, "seq_len": 64, "tokenizer": "tokenizer.model"})
    write_integrity(step, _ONE_PROCESS)
    (step / COMMIT_MARKER).write_text("{}")
    return model, step


@pytest.mark.parametrize("with_export", [True, False], ids=["eval-export", "engine-state"])
def test_checkpoint_becomes_a_loadable_export(tmp_path, bpe_tokenizer, with_export):
    model, step = _checkpoint(tmp_path, bpe_tokenizer, with_export)
    out = export_checkpoint(step, tmp_path / "out")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 45), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(load_pretrained(out)(ids).logits, expected)
        assert (hf(ids, use_cache=False).logits - expected).abs().max() <= 1e-5
    assert (out / "tokenizer.model").read_bytes() == bpe_tokenizer
    assert AutoTokenizer.from_pretrained(out).encode("the river") != []
    assert json.loads((out / "config.json").read_text())["export"]["step"] == 10


def test_refuses_what_is_not_a_committed_intact_checkpoint(tmp_path, bpe_tokenizer):
    _, step = _checkpoint(tmp_path, bpe_tokenizer, with_export=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_checkpoint(step, tmp_path / "taken")
    with open(step / "state.pt", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointCorruptError, match="state.pt"):
        export_checkpoint(step, tmp_path / "out")
    (step / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointError, match="not a committed training checkpoint"):
        export_checkpoint(step, tmp_path / "out2")


def test_refuses_a_tokenizer_other_than_the_trained_one(tmp_path, bpe_tokenizer):
    _, step = _checkpoint(tmp_path, bpe_tokenizer, with_export=False)
    (tmp_path / "data" / "tokenizer.model").write_bytes(bpe_tokenizer + b"changed")
    with pytest.raises(CheckpointError, match="not the one this checkpoint was trained with"):
        export_checkpoint(step, tmp_path / "out")


def test_cli_exports_a_checkpoint_or_an_older_export_and_refuses_with_status_2(tmp_path, bpe_tokenizer):
    from pipeline.cli.export import main

    model, step = _checkpoint(tmp_path, bpe_tokenizer, with_export=False)
    assert main(["--checkpoint", str(step), "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "modeling_gca.py").is_file() and (tmp_path / "a" / "tokenizer.json").is_file()
    plain = tmp_path / "plain"
    save_pretrained(model, plain)  # an export as releases before the Hugging Face files wrote it
    assert main(["--checkpoint", str(plain), "--out", str(tmp_path / "b")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "b", trust_remote_code=True).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert (hf(ids, use_cache=False).logits - model(ids).logits).abs().max() <= 1e-5
    (step / "trainer_state.json").write_text("{}")
    assert main(["--checkpoint", str(step), "--out", str(tmp_path / "c")]) == 2
    assert main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]) == 2
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def _older_export(tmp_path, tokenizer: bytes):
    """An export as releases before the Hugging Face files wrote it: config, weights, tokenizer."""
    (tmp_path / "run").mkdir()
    model, _ = _checkpoint(tmp_path / "run", tokenizer, with_export=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.model").write_bytes(tokenizer)
    save_pretrained(model, plain, extra={"tokenizer": "tokenizer.model"})
    return plain


def _link_weights_elsewhere(plain):
    outside = plain.parent / "outside.safetensors"
    (plain / "model.safetensors").rename(outside)
    (plain / "model.safetensors").symlink_to(outside)


def _fifo_tokenizer(plain):
    (plain / "tokenizer.model").unlink()
    os.mkfifo(plain / "tokenizer.model")


def _tokenizer_outside(plain):
    config = json.loads((plain / "config.json").read_text())
    config["export"]["tokenizer"] = "../tokenizer.model"
    (plain / "config.json").write_text(json.dumps(config))
    (plain.parent / "tokenizer.model").write_bytes((plain / "tokenizer.model").read_bytes())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hostile", [_link_weights_elsewhere, _fifo_tokenizer, _tokenizer_outside])
def test_a_hostile_export_is_refused_before_anything_is_written(tmp_path, bpe_tokenizer, hostile, capsys):
    """Only the export's own regular files are copied: a link out of it, a FIFO (never opened for reading, so
    nothing blocks) or a tokenizer name leaving it is an error naming the file, with exit 2 and no output."""
    from pipeline.cli.export import main

    plain = _older_export(tmp_path, bpe_tokenizer)
    hostile(plain)
    before = sorted((p.name, p.lstat().st_size) for p in tmp_path.iterdir())
    assert main(["--checkpoint", str(plain), "--out", str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert sorted((p.name, p.lstat().st_size) for p in tmp_path.iterdir()) == before


def test_an_exports_tokenizer_link_gets_no_tokenizer_files(tmp_path, bpe_tokenizer, caplog):
    """write_hf_files (the trainer's path) reads the tokenizer only as a regular file inside the export."""
    from pipeline.hf import write_hf_files

    plain = _older_export(tmp_path, bpe_tokenizer)
    outside = tmp_path / "elsewhere.model"
    (plain / "tokenizer.model").rename(outside)
    (plain / "tokenizer.model").symlink_to(outside)
    write_hf_files(plain)
    assert not (plain / "tokenizer.json").exists() and "no Hugging Face tokenizer files" in caplog.text
    assert (plain / "modeling_gca.py").is_file()


def test_an_export_that_already_has_the_hugging_face_files_is_refused_naming_what_to_pass(
    tmp_path, bpe_tokenizer, capsys
):
    """``--checkpoint <an export>`` (issue 65, finding 8: it was copied without a word): one line saying it is
    already an export and naming the checkpoint to pass instead, exit 2, nothing written."""
    import shutil

    from pipeline.cli.export import main
    from pipeline.hf import write_hf_files

    _, step = _checkpoint(tmp_path, bpe_tokenizer, with_export=True)
    assert main(["--checkpoint", str(step), "--out", str(tmp_path / "done")]) == 0
    capsys.readouterr()
    beside = tmp_path / "run" / "export"  # a run's own eval export, next to its checkpoints
    shutil.copytree(tmp_path / "done", beside)
    write_hf_files(step / "export")  # the trainer's checkpoints hold complete exports
    cases = {
        tmp_path / "done": "a training checkpoint, --checkpoint <run_dir>/checkpoints/step_N",
        beside: f"a checkpoint of that run, e.g. --checkpoint {step}",
        step / "export": f"its checkpoint, --checkpoint {step}",
    }
    for export, instead in cases.items():
        before = sorted(p.name for p in tmp_path.iterdir())
        assert main(["--checkpoint", str(export), "--out", str(tmp_path / "again")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --checkpoint {export} is already an export") and err.count("\n") == 1, err
        assert err.endswith(f"to export a training step, pass {instead}\n"), err
        assert sorted(p.name for p in tmp_path.iterdir()) == before

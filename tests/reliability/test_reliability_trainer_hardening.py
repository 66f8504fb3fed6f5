"""Trainer hardening: exact resume with the default settings, deletion of only what the trainer wrote, inputs
refused before any work, Ctrl-C, failed evaluations, and values from the environment kept out of output and files.

Every run uses the default trainer settings that matter here (eval export on, default ``keep_last``, default engine
and attention backend) on the tiny model and dataset of reliability_harness.py. References are independent runs:
an uninterrupted run, runs that save at other steps, the file system as it was before.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.distributed
from reliability_harness import (
    CONFIG,
    assert_same_checkpoint,
    assert_same_steps,
    committed,
    overrides,
    read_metrics,
    train_process,
    write_dataset,
)
from safetensors.torch import load_file, save_file

from pipeline.train.checkpoint import COMMIT_MARKER, OWNER_FILE
from pipeline.train.config import load_config
from pipeline.train.metrics import setup_logging
from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability

STEPS = 10
_HARNESS_CHOICES = (
    "checkpoint.export",
    "checkpoint.keep_last",
    "checkpoint.every",
    "model.gca_backend",
    "model.swa_backend",
)
"""Settings the harness pins for speed; these tests leave them at the trainer's defaults unless they say so."""


def args(run: Path, data: Path, **extra: object) -> list[str]:
    """The harness's tiny model with the trainer's default checkpoint, export and backend settings."""
    pinned = [
        a for a in overrides(run, data, **{"train.max_steps": STEPS}) if a.split("=", 1)[0] not in _HARNESS_CHOICES
    ]
    return [*pinned, *(f"{k}={v}" for k, v in extra.items())]


def starts(run: Path) -> list[int]:
    return [
        json.loads(line)["start_step"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if '"start_step"' in line
    ]


def same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "export/model.safetensors"), load_file(b / "export/model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"exported tensor {name} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """Uninterrupted, all defaults: no periodic checkpoint (checkpoint.every=0), one save and export at the end."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(None, args(run, data)) == 0
    return run


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- exact resume with the default settings -------------------------------------------------------------------------


def test_sigkill_between_checkpoints_then_relaunch_is_exact_and_saving_often_changes_nothing(reference, data, tmp_path):
    """The export inside every checkpoint builds a model; its random init once advanced the training RNG (Gumbel
    noise), so runs diverged from the first checkpoint on. Now: saving every 2 steps, every 5 steps, or only at
    the end gives hex-identical losses; SIGKILL at step 7 (not a checkpoint step) and relaunching the same command
    (in this process, to save a start-up) resumes from step 5 and ends with torch.equal weights, optimizer, RNG
    and data state."""
    every2 = tmp_path / "every2"
    assert main(None, args(every2, data, **{"checkpoint.every": 2})) == 0
    killed = tmp_path / "killed"
    command = args(killed, data, **{"checkpoint.every": 5})
    first = train_process(command, fault="kill:step=7")
    assert first.returncode == -9, first.output[-3000:]
    assert committed(killed) == ["step_00000005"] and max(read_metrics(killed)) == 7
    assert main(CONFIG, command) == 0  # what launch/pretrain.py --config CONFIG <command> runs
    assert starts(killed) == [0, 5]
    for run in (every2, killed):
        assert_same_steps(reference, run, range(1, STEPS + 1))
        same_weights(reference, run)
    final = f"checkpoints/step_{STEPS:08d}"
    assert_same_checkpoint(every2 / final, killed / final)
    assert_same_checkpoint(reference / final, killed / final)


# -- failed evaluation, empty validation split ----------------------------------------------------------------------


def test_failed_evaluation_saves_the_step_first_and_does_not_touch_the_trajectory(
    reference, data_copy, data, tmp_path, caplog, monkeypatch
):
    """The validation shards vanish after the start checks: the eval at step 3 fails, step 3 is saved before the
    run stops (exit 1, one error line), and the relaunch with the shards back resumes at 3 and ends exactly like the
    run that never evaluated."""
    import pipeline.train.trainer

    run = tmp_path / "run"
    shards = sorted((data_copy / "val").glob("shard.*"))
    assert shards
    checked = pipeline.train.trainer.check_inputs

    def check_then_remove(cfg):  # the start check confirms the shards exist; they go right after it
        checked(cfg)
        for shard in shards:
            shard.unlink()

    command = args(run, data_copy, **{"train.eval_every": 3})
    with caplog.at_level(logging.ERROR), monkeypatch.context() as patch:
        patch.setattr(pipeline.train.trainer, "check_inputs", check_then_remove)
        assert main(None, command) == 1
    assert committed(run) == ["step_00000003"] and max(read_metrics(run)) == 3
    [message] = errors(caplog)
    assert re.search(r"validation at step 3 failed on rank\(s\) \[0\].*step 3 was saved first", message), message
    assert "train.eval_every=0" in message and "\n" not in message
    shutil.copytree(data / "val", data_copy / "val", dirs_exist_ok=True)
    assert main(None, command) == 0
    assert starts(run) == [0, 3]
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["step"] for e in evals] == [6, 9]
    assert_same_steps(reference, run, range(1, STEPS + 1))
    same_weights(reference, run)


def test_empty_validation_split_is_refused_before_any_work(tmp_path, caplog):
    data = write_dataset(tmp_path / "data", n_train=40, n_val=0)
    assert json.loads((data / "val/index.json").read_text())["shards"] == []
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data, **{"train.eval_every": 2})) == 2
    [message] = errors(caplog)
    assert "train.eval_every=2" in message and f"data.path={data} has an empty validation split 'val'" in message
    assert "set train.eval_every=0" in message
    assert not run.exists() and not torch.distributed.is_initialized()
    caplog.clear()
    assert main(None, args(run, data, **{"train.max_steps": 3})) == 0, "without evaluation the data is fine"


def test_a_split_swapped_in_from_another_prep_is_refused_before_any_work(data, tmp_path, caplog):
    """The manifest records each split's index hash; a train/ copied from another prep (another tokenizer's ids in
    a real mix-up) must not train silently, and neither may a val/ the manifest counts but the disk lacks."""
    other = write_dataset(tmp_path / "other", n_train=120, n_val=25)
    for split, extra in (("train", {}), ("val", {"train.eval_every": 2})):
        swapped = Path(shutil.copytree(data, tmp_path / f"swapped_{split}"))
        shutil.rmtree(swapped / split)
        shutil.copytree(other / split, swapped / split)
        run = tmp_path / f"run_{split}"
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert main(None, args(run, swapped, **extra)) == 2
        [message] = errors(caplog)
        assert f"data.path={swapped} (data.{split}_split={split})" in message
        assert f"{swapped / split / 'index.json'} is not the one data prep recorded in manifest.json" in message
        assert "re-run data prep, or restore the split it wrote" in message and "\n" not in message
        assert not run.exists() and not torch.distributed.is_initialized()
        shutil.rmtree(swapped / split)
        shutil.copytree(data / split, swapped / split)  # the split prep wrote, back in place: the run trains
        assert main(None, args(run, swapped, **{**extra, "train.max_steps": 3})) == 0


def test_a_missing_validation_split_is_refused_before_any_work_not_at_the_first_validation(data_copy, tmp_path, caplog):
    """The start check reads the split on disk, not the manifest's count of it: with val/ gone, the run stops
    before step 1 (before: it failed at the first validation, and relaunched after its last step, exited 0
    without ever validating)."""
    shutil.rmtree(data_copy / "val")
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data_copy, **{"train.eval_every": 2})) == 2
    [message] = errors(caplog)
    assert f"{data_copy / 'val' / 'index.json'} is missing, though manifest.json records" in message
    assert not run.exists()
    caplog.clear()
    assert main(None, args(run, data_copy, **{"train.max_steps": 3})) == 0, "without evaluation val/ is not read"


@pytest.mark.parametrize("manifest", [True, False], ids=["prepared", "hand_written"])
def test_a_linked_split_index_is_refused_before_any_work(manifest, data_copy, tmp_path, caplog):
    """The start check reads a split's index.json as the readers do: a symbolic link planted there (to a file
    outside the dataset) is never followed, with or without a manifest."""
    if not manifest:
        (data_copy / "manifest.json").unlink()
        (data_copy / "_COMPLETE").unlink()
    outside = tmp_path / "outside.json"
    outside.write_bytes((data_copy / "val" / "index.json").read_bytes())
    (data_copy / "val" / "index.json").unlink()
    (data_copy / "val" / "index.json").symlink_to(outside)
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data_copy, **{"train.eval_every": 2})) == 2
    [message] = errors(caplog)
    assert str(data_copy / "val" / "index.json") in message and "symbolic link" in message, message
    assert not run.exists()


# -- inputs checked before any work --------------------------------------------------------------------------------


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(data, tmp_path, caplog):
    pieces = spm.SentencePieceProcessor(model_file=str(data / "tokenizer.model")).get_piece_size()
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data, **{"model.vocab_size": pieces - 1})) == 2
    [message] = errors(caplog)
    assert f"has {pieces} pieces but model.vocab_size={pieces - 1}" in message
    assert f"set model.vocab_size={pieces}" in message and str(data / "tokenizer.model") in message
    assert not run.exists()


@pytest.mark.parametrize("needle_mix", [0.0, 0.5])
def test_a_tokenizer_that_is_a_link_is_refused_and_its_target_never_read(needle_mix, data_copy, tmp_path, caplog):
    """A ``tokenizer.model`` planted as a symbolic link (here to a FIFO, which would block any reader) is one line
    naming the file, before any work; the trainer never follows it (the needle inserter and the export read the
    bytes the start checks read)."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (data_copy / "tokenizer.model").unlink()
    (data_copy / "tokenizer.model").symlink_to(fifo)
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data_copy, **{"data.needle_mix": needle_mix})) == 2
    [message] = errors(caplog)
    assert f"{data_copy / 'tokenizer.model'} is a symbolic link, not a regular file" in message, message
    assert not run.exists()


@pytest.mark.parametrize("damage", ["pickle", "truncated"])
def test_a_damaged_init_from_export_is_one_line_naming_the_file(damage, reference, data, tmp_path, caplog):
    """``checkpoint.init_from`` pointing at an export whose weights are a pickle or cut short: a configuration
    error naming the file, checked from the safetensors header alone (nothing unpickled, no tensor loaded)."""
    export = Path(shutil.copytree(reference / "export", tmp_path / "export"))
    weights = export / "model.safetensors"
    if damage == "pickle":
        torch.save({"w": torch.zeros(2)}, weights)
    else:
        weights.write_bytes(weights.read_bytes()[:-100])
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data, **{"checkpoint.init_from": export})) == 2
    [message] = errors(caplog)
    assert message.startswith("configuration error: checkpoint.init_from: ") and str(weights) in message, message
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_an_init_from_export_with_a_non_finite_weight_is_refused_naming_the_tensor(
    value, reference, data, tmp_path, caplog
):
    """A diverged run's export as ``checkpoint.init_from``: before, the new stage started and its first step was a
    NaN loss (T14, far from the cause). Now exit 2 with one line naming the file and the tensor, before any step."""
    export = Path(shutil.copytree(reference / "export", tmp_path / "export"))
    weights = export / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name].view(-1)[3] = value
    save_file(tensors, weights)
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data, **{"checkpoint.init_from": export})) == 2
    [message] = errors(caplog)
    assert message.startswith("configuration error: checkpoint.init_from: ") and str(weights) in message, message
    assert f"tensor {name} holds 1 non-finite value(s)" in message, message
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.grad_clip", "nan", "train.grad_clip must be a finite number; got nan"),
        ("train.grad_clip", "inf", "train.grad_clip must be a finite number; got inf"),
        ("train.grad_clip", "-1.0", "train.grad_clip must be >= 0; got -1.0"),
        ("optim.lr", "nan", "optim.lr must be a finite number; got nan"),
        ("optim.lr", "-0.001", "optim.lr must be > 0; got -0.001"),
        ("optim.min_lr", "inf", "optim.min_lr must be a finite number; got inf"),
        ("optim.weight_decay", "-0.1", "optim.weight_decay must be >= 0; got -0.1"),
        ("optim.betas", "[0.9,nan]", r"optim.betas[1] must be a finite number; got nan"),
        ("optim.betas", "[0.9,1.0]", "optim.betas must be two values in [0, 1); got [0.9, 1.0]"),
        ("optim.eps", "0.0", "optim.eps must be > 0; got 0.0"),
        ("schedule.warmup_steps", "-1", "schedule.warmup_steps must be >= 0; got -1"),
        ("data.needle_mix", "nan", "data.needle_mix must be a finite number; got nan"),
        ("data.needle_answer_weight", "inf", "data.needle_answer_weight must be a finite number; got inf"),
        ("data.needle_answer_weight", "0.0", "data.needle_answer_weight must be > 0; got 0.0"),
        ("model.norm_eps", "nan", "model.norm_eps must be a finite number > 0; got nan"),
        ("model.init_std", "inf", "model.init_std must be a finite number > 0; got inf"),
        ("model.rope_theta", "0.0", "model.rope_theta must be a finite number > 0; got 0.0"),
        ("logging.peak_tflops", "-5.0", "logging.peak_tflops must be > 0 (or null to guess); got -5.0"),
        ("seed", "-1", "seed must be >= 0; got -1"),
        ("train.eval_batches", "0", "train.eval_batches must be >= 1; got 0"),
        ("train.requeue_exit_code", "0", "train.requeue_exit_code must be an exit code in 1..255; got 0"),
    ],
)
def test_bad_numbers_are_refused_naming_key_and_value(key, value, message, data, tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert main(None, [*args(run, data), f"{key}={value}"]) == 2
    [error] = errors(caplog)
    assert message in error, error
    assert not run.exists() and not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "text, shown",
    [
        ("- train\n- model\n", "the top level must be a mapping of train keys, not a list"),
        ("42\n", "the top level must be a mapping of train keys, not a single value"),
        ("train: [1,\n", "not valid YAML (expected the node content, but found '<stream end>' at line 2, column 1)"),
    ],
)
def test_yaml_that_is_not_a_mapping_is_one_line_naming_the_file(text, shown, data, tmp_path, caplog):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with caplog.at_level(logging.ERROR):
        assert main(str(config), args(tmp_path / "run", data)) == 2
    [error] = errors(caplog)
    assert f"config file {config}" in error and shown in error and "\n" not in error, error


# -- deletion: only what this trainer wrote -------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_uncommitted_directories_the_trainer_did_not_write_are_never_deleted(data, tmp_path, caplog):
    """Leftovers without the trainer's OWNER.json (a directory, a .tmp, a symlink to elsewhere) stop the run before
    any work, naming the path and the fix; nothing in them or behind the symlink changes."""
    run = tmp_path / "run"
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("keep me")
    (elsewhere / OWNER_FILE).write_text(json.dumps({"writer": "gca-pretrain trainer", "step": 2}))
    ckpts = run / "checkpoints"
    (ckpts / "step_00000004").mkdir(parents=True)
    (ckpts / "step_00000004/state.pt").write_bytes(b"someone else's")
    (ckpts / "step_00000006.tmp").mkdir()
    (ckpts / "step_00000006.tmp/data.bin").write_bytes(b"also not ours")
    (ckpts / "step_00000002").symlink_to(elsewhere, target_is_directory=True)
    before, outside = _tree(ckpts), _tree(elsewhere)
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data, **{"checkpoint.every": 2})) == 2
    [error] = errors(caplog)
    assert re.search(
        r"checkpoints/step_0000000[246](\.tmp)? is not a committed checkpoint and was not written by "
        r"this trainer \(no OWNER\.json\).*move it out of .*checkpoints and relaunch \(2 more",
        error,
    )
    assert _tree(ckpts) == before and _tree(elsewhere) == outside
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"], "nothing started"


def test_keep_last_prunes_only_its_own_checkpoints(data, tmp_path, caplog):
    """A committed checkpoint copied in from elsewhere (no OWNER.json) is resumable but never pruned, and a save
    that would land on it is refused naming it (one line, exit 2); the trainer's own checkpoints are pruned to
    keep_last."""
    run = tmp_path / "run"
    assert main(None, args(run, data, **{"train.max_steps": 4, "checkpoint.every": 2, "checkpoint.keep_last": 1})) == 0
    assert committed(run) == ["step_00000004"]
    foreign = run / "checkpoints/step_00000003"
    foreign.mkdir()
    (foreign / COMMIT_MARKER).write_text("{}")
    (foreign / "model.bin").write_bytes(b"a checkpoint from another tool")
    before = _tree(foreign)
    assert main(None, args(run, data, **{"train.max_steps": 8, "checkpoint.every": 2, "checkpoint.keep_last": 1})) == 0
    assert starts(run) == [0, 4] and committed(run) == ["step_00000003", "step_00000008"]
    assert _tree(foreign) == before
    caplog.clear()
    assert main(None, args(run, data, **{"train.max_steps": 3, "checkpoint.resume": "none"})) == 2
    (line,) = errors(caplog)
    assert re.search(
        r"step_00000003 is in the way of the save of step 3 and was not written by this trainer .*move it out", line
    )
    assert _tree(foreign) == before


# -- Ctrl-C ---------------------------------------------------------------------------------------------------------


def test_first_ctrl_c_saves_and_exits_130_then_resumes_exactly(reference, data, tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    monkeypatch.setenv("PIPE_FAULT", "sigint:step=3")
    with caplog.at_level(logging.WARNING):
        assert main(None, args(run, data)) == 130
    assert committed(run) == ["step_00000003"]
    assert "press Ctrl-C again to stop at once without saving" in caplog.text
    monkeypatch.delenv("PIPE_FAULT")
    assert main(None, args(run, data)) == 0
    assert starts(run) == [0, 3]
    assert_same_steps(reference, run, range(1, STEPS + 1))
    same_weights(reference, run)


def test_second_ctrl_c_stops_at_once_and_its_torn_save_is_removed_later(data, tmp_path, monkeypatch, caplog):
    """The second Ctrl-C lands inside the save the first one asked for: exit 130 at once, nothing committed; the
    torn save carries the trainer's OWNER.json, so the next start removes it and trains from scratch."""
    run = tmp_path / "run"
    monkeypatch.setenv("PIPE_FAULT", "sigint:step=3,signal_during_save:step=3:at=engine:sig=int")
    with caplog.at_level(logging.ERROR):
        assert main(None, args(run, data)) == 130
    assert "stopped at once by Ctrl-C (a second one" in " ".join(errors(caplog))
    assert "nothing saved since the last committed checkpoint" in " ".join(errors(caplog))
    assert committed(run) == []
    torn = run / "checkpoints/step_00000003.tmp"
    assert json.loads((torn / OWNER_FILE).read_text())["step"] == 3
    monkeypatch.delenv("PIPE_FAULT")
    assert main(None, args(run, data, **{"train.max_steps": 4})) == 0
    assert not torn.exists() and committed(run) == ["step_00000004"] and starts(run) == [0, 0]


# -- values from the environment and secret shapes ------------------------------------------------------------------

SENTINEL = "zq7sentinelvalue"


def _files_holding(root: Path, needle: str) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle.encode() in p.read_bytes()]


def test_environment_values_stay_out_of_output_and_every_file(data, tmp_path, monkeypatch, capfd, caplog):
    """``${oc.env:MY_RUN_NAME}`` in run_dir and ``${oc.env:MY_PROJECT}`` in logging.wandb_project: the values
    appear nowhere in the output or under run_dir (config.yaml, checkpoints, trainer state, export, metrics),
    and the saved config.yaml keeps the interpolations and loads back to the same run directory."""
    parent = tmp_path / "runs"
    project = "prj" + SENTINEL
    run = parent / SENTINEL
    monkeypatch.setenv("MY_RUN_NAME", SENTINEL)
    monkeypatch.setenv("MY_PROJECT", project)
    command = args(
        Path(str(parent) + "/${oc.env:MY_RUN_NAME}"),
        data,
        **{
            "logging.wandb_project": "${oc.env:MY_PROJECT}",
            "train.max_steps": 3,
            "checkpoint.every": 2,
            "train.eval_every": 2,
        },
    )
    with caplog.at_level(logging.DEBUG):
        assert main(None, command) == 0
    out, err = capfd.readouterr()
    assert committed(run) == ["step_00000002", "step_00000003"] and (run / "export/model.safetensors").is_file()
    assert "/${oc.env:MY_RUN_NAME}/checkpoints" in err, "the log says where things are, without the value"
    assert SENTINEL not in out + err + caplog.text
    assert _files_holding(run, SENTINEL) == []
    saved = (run / "config.yaml").read_text()
    assert "wandb_project: ${oc.env:MY_PROJECT}" in saved and "/${oc.env:MY_RUN_NAME}" in saved
    reloaded = load_config(str(run / "config.yaml"))
    assert reloaded.run_dir == str(run) and reloaded.logging.wandb_project == project


def test_a_bad_environment_value_is_not_echoed_in_the_error(data, tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setenv("MY_BAD", "notanumber" + SENTINEL)
    with caplog.at_level(logging.ERROR):
        assert main(None, [*args(tmp_path / "run", data), "train.max_steps=${oc.env:MY_BAD}"]) == 2
    out, err = capfd.readouterr()
    [error] = errors(caplog)
    assert "config key 'train.max_steps' has a wrong value" in error and "${oc.env:MY_BAD}" in error
    assert SENTINEL not in out + err + caplog.text and not (tmp_path / "run").exists()


def test_secret_shapes_are_redacted_in_logs_and_refused_in_the_config(data, tmp_path, capfd, caplog):
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh"
    setup_logging(0)
    logging.getLogger("pipeline.test").warning("downloading with %s", token)
    with caplog.at_level(logging.ERROR):
        assert main(None, [*args(tmp_path / "run", data), f"logging.wandb_project={token}"]) == 2
    out, err = capfd.readouterr()
    assert "downloading with <redacted>" in err
    assert "config key 'logging.wandb_project' holds what looks like a credential" in caplog.text
    assert token not in out + err + caplog.text and not (tmp_path / "run").exists()

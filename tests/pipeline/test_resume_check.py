"""A resume with a changed config (pipeline/train/resume_check.py): every row of its table on real runs.

One 5-step run, stopped by SIGUSR1 after step 3 (checkpoint and export at step 3, default settings otherwise), is
made once; each test puts a pristine copy of it back at the same run_dir and relaunches the trainer with the
changes under test, so they are the only differences the resume sees.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import read_metrics, tiny_overrides

from pipeline.train.resume_check import RULES, _flatten, classify, config_changes
from pipeline.train.trainer import main

REPO = Path(__file__).resolve().parents[2]
STEPS, SAVED = 5, 3
CKPT = f"checkpoints/step_{SAVED:08d}"
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_data):
    """(run_dir every test resumes in, a pristine copy of the run stopped at step 3 made there)."""
    root = tmp_path_factory.mktemp("resume_check")
    run = root / "run"
    os.environ["PIPE_FAULT"] = f"sigusr1:step={SAVED}"
    try:
        assert main(None, tiny_overrides(run, tiny_data, **{"train.max_steps": STEPS})) == 75
    finally:
        del os.environ["PIPE_FAULT"]
    assert (run / CKPT / "export" / "model.safetensors").is_file(), "checkpoint.export is on by default"
    shutil.copytree(run, root / "pristine")
    return run, root / "pristine"


@pytest.fixture
def resume(pristine, tiny_data, caplog, monkeypatch):
    """``resume(**changes)`` -> exit code of relaunching the stopped run with ``changes``; the log is in caplog."""
    run, copy = pristine
    for name in LAUNCHER_VARS:  # an in-process FSDP launch writes them; undone after the test
        monkeypatch.delenv(name, raising=False)

    def relaunch(**changes: object) -> int:
        shutil.rmtree(run)
        shutil.copytree(copy, run)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            return main(None, tiny_overrides(run, tiny_data, **{"train.max_steps": STEPS, **changes}))

    relaunch.run = run  # type: ignore[attr-defined]
    return relaunch


def _block(caplog) -> str:
    [record] = [r for r in caplog.records if r.name == "pipeline.train.resume_check"]
    return record.getMessage()


def _warnings_of_the_check(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pipeline.train.resume_check" and r.levelno >= logging.WARNING]


def _assert_no_traceback(caplog) -> None:
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a changed config"


# One real change per row of RULES, keyed by the row's first pattern: (key, new value, the block's "old -> new").
REFUSED = {
    "model.*": ("model.d_model", 48, "32 -> 48"),
    "parallel.engine": ("parallel.engine", "fsdp", "none -> fsdp"),
    "seed": ("seed", 8, "7 -> 8"),
    "train.seq_len": ("train.seq_len", 32, "64 -> 32"),
    "train.global_batch": ("train.global_batch", 8, "4 -> 8"),
    "data.shuffle": ("data.shuffle_window", 16, "8 -> 16"),
    "optim.trainable": ("optim.trainable", "new", "all -> new"),
}
WARNED = {
    "train.max_steps": ("train.max_steps", 6, "5 -> 6"),
    "optim.*": ("optim.weight_decay", 0.05, "0.1 -> 0.05"),
    "precision.*": ("precision.dtype", "fp32", "auto -> fp32"),
    "data.needle_mix": ("data.needle_mix", 0.25, "0.0 -> 0.25"),
}
SILENT = {
    "model.gca_backend": ("model.gca_backend", "matmul", "naive -> matmul"),
    "train.micro_batch": ("train.micro_batch", 1, "2 -> 1"),
    "train.eval_every": ("train.eval_every", 2, "0 -> 2"),
    "run_dir": ("data.validate_hash", "xxh64", "null -> xxh64"),
    "parallel.*": ("parallel.activation_checkpointing", True, "false -> true"),
    "checkpoint.*": ("logging.every", 2, "1 -> 2"),
}
# Rows no key of today's schema reaches (section defaults and the catch-all), and the retrieval-mix row whose keys
# another change adds to the schema: classified by name.
BY_NAME = {
    "data.retrieval_mix*": ("data.retrieval_mix.fraction", "warned"),
    "data.sources": ("data.sources", "silent"),
    "train.*": ("train.some_new_knob", "warned"),
    "data.*": ("data.some_new_knob", "refused"),
    "*": ("some_new_section.knob", "refused"),
}


def _cases(table: dict) -> list:
    return [pytest.param(*case, id=row) for row, case in table.items()]


def test_every_row_of_the_table_has_a_case_here():
    assert sorted([*REFUSED, *WARNED, *SILENT, *BY_NAME]) == sorted(rule.keys[0] for rule in RULES)
    for row, (key, _, _) in {**REFUSED, **WARNED, **SILENT}.items():
        assert classify(key) is classify(row), f"{key} is not in the row of {row}"


@pytest.mark.parametrize(("key", "new", "shown"), _cases(REFUSED))
def test_refused_change_stops_before_any_step_with_one_line(resume, caplog, key, new, shown):
    assert resume(**{key: new}) == 2
    _assert_no_traceback(caplog)
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    ckpt = resume.run / CKPT
    assert "\n" not in error
    assert error.startswith(f"configuration error: cannot resume {ckpt}: {key}: {shown} changes {classify(key).why}; ")
    assert (
        f"; set it back to resume this run, or start a new run in another run_dir (checkpoint.init_from={ckpt}/export "
        in error
    )
    assert (ckpt / "export" / "model.safetensors").is_file(), "the way out names a real export"
    assert f"  {key}: {shown}  [refused: changes " in _block(caplog)
    assert sorted(p.name for p in (resume.run / "checkpoints").iterdir()) == [ckpt.name]
    assert max(read_metrics(resume.run)) == SAVED, "no step ran"


def test_refused_seq_len_way_out_starts_a_new_run_from_the_checkpoint_weights(resume, tiny_data, tmp_path):
    assert resume(**{"train.seq_len": 32}) == 2
    export = resume.run / CKPT / "export"
    new_run = tmp_path / "stage2"
    changes = {"train.seq_len": 32, "train.max_steps": 3, "checkpoint.init_from": export}
    assert main(None, tiny_overrides(new_run, tiny_data, **changes)) == 0
    stage2, base = read_metrics(new_run), read_metrics(resume.run)
    assert sorted(stage2) == [1, 2, 3], "a new run of its own"
    # Trained weights, not a fresh init: its first loss is already below the base run's first (a fresh init).
    assert stage2[1]["loss"] < base[1]["loss"] - 0.05, (stage2[1]["loss"], base[1]["loss"])


def test_refused_architecture_lists_every_changed_field(resume, caplog):
    assert resume(**{"model.d_model": 48, "model.ffn_hidden": 96}) == 2
    _assert_no_traceback(caplog)
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert re.search(
        r"model\.d_model: 32 -> 48 changes the architecture; model\.ffn_hidden: 64 -> 96 changes the "
        r"architecture; set them back .* starts it from these weights if every tensor shape still fits\)$",
        error,
    )


@pytest.mark.parametrize(("key", "new", "shown"), _cases(WARNED))
def test_warned_change_resumes_with_a_warning(resume, caplog, key, new, shown):
    assert resume(**{key: new}) == 0
    _assert_no_traceback(caplog)
    [warning] = _warnings_of_the_check(caplog)
    assert f"  {key}: {shown}  [warned: changes {classify(key).why} from step {SAVED + 1} on]" in warning.getMessage()
    last = new if key == "train.max_steps" else STEPS
    assert sorted(read_metrics(resume.run)) == list(range(1, last + 1)), "resumed and finished"


@pytest.mark.parametrize(("key", "new", "shown"), _cases(SILENT))
def test_silent_change_is_listed_without_a_warning(resume, caplog, key, new, shown):
    assert resume(**{key: new}) == 0
    _assert_no_traceback(caplog)
    assert f"  {key}: {shown}  [allowed: {classify(key).why}]" in _block(caplog)
    assert not _warnings_of_the_check(caplog)
    assert sorted(read_metrics(resume.run)) == list(range(1, STEPS + 1))


@pytest.mark.parametrize(("row", "key", "kind"), [pytest.param(row, *case, id=row) for row, case in BY_NAME.items()])
def test_keys_without_a_row_of_their_own_take_their_section_default(row, key, kind):
    assert classify(key).kind == kind and classify(key).keys[0] == row


def _cosine_lr(step: int, max_steps: int, lr: float = 3e-3, min_lr: float = 3e-4, warmup: int = 2) -> float:
    """The tiny runs' schedule (tests/helpers.py TINY_TRAIN_OVERRIDES), written out: linear warm-up, then cosine
    from lr to min_lr at the last step; 0-based step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(max_steps - 1 - warmup, 1), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def test_a_longer_run_states_the_learning_rate_jump_at_the_resume_step(resume, caplog):
    """Relaunched with train.max_steps=8, the cosine of the 5-step run is stretched: step 4 jumps to the new curve,
    and the block says so with both numbers."""
    assert resume(**{"train.max_steps": 8}) == 0
    before, after = _cosine_lr(SAVED, STEPS), _cosine_lr(SAVED, 8)
    assert (round(before, 9), round(after, 6)) == (1.65e-3, 2.742e-3)
    assert (
        "  train.max_steps: 5 -> 8  [warned: changes the learning-rate schedule from step 4 on]\n"
        f"  learning rate at step 4: {before:.2e} under the checkpoint's config -> {after:.2e} under this one"
    ) in _block(caplog)
    steps = read_metrics(resume.run)
    assert steps[4]["lr"] == pytest.approx(after, rel=1e-12), "the trainer really uses the new curve"
    assert steps[3]["lr"] == pytest.approx(_cosine_lr(SAVED - 1, STEPS), rel=1e-12)


def test_a_changed_peak_learning_rate_is_stated_too(resume, caplog):
    assert resume(**{"optim.lr": 6e-3}) == 0
    before, after = _cosine_lr(SAVED, STEPS), _cosine_lr(SAVED, STEPS, lr=6e-3)
    assert "  optim.lr: 0.003 -> 0.006  [warned: changes the optimizer update from step 4 on]" in _block(caplog)
    assert f"learning rate at step 4: {before:.2e} under the checkpoint's config -> {after:.2e}" in _block(caplog)


def test_an_unchanged_config_resumes_quietly(resume, caplog):
    assert resume() == 0
    assert "with the config it was saved with" in _block(caplog) and not _warnings_of_the_check(caplog)


def test_values_from_the_environment_stay_interpolations_in_the_block(resume, caplog, monkeypatch):
    secret = "sentinel-project-5c1d"
    monkeypatch.setenv("GCA_TEST_PROJECT", secret)
    assert resume(**{"logging.wandb_project": "${oc.env:GCA_TEST_PROJECT}"}) == 0
    assert "  logging.wandb_project: gca-pretrain -> ${oc.env:GCA_TEST_PROJECT}  [allowed: " in _block(caplog)
    assert secret not in caplog.text


def test_a_key_the_checkpoint_does_not_record_compares_as_its_default():
    """A key added to the schema after the save: unchanged while it keeps its default."""
    saved = "run_dir: r\ndata:\n  path: d\n"
    assert config_changes(saved, "run_dir: r\ndata:\n  path: d\n  shuffle: true\n") == []
    [change] = config_changes(saved, "run_dir: r\ndata:\n  path: d\n  shuffle: false\n")
    assert (change.key, change.old, change.new, change.rule.kind) == ("data.shuffle", True, False, "refused")


def test_a_mapping_the_user_fills_is_one_value():
    """Inside a section every key is compared on its own; a dict-valued key (the retrieval mix's families) is one
    value, so dropping one of its entries is a change, never a key that vanished from the schema."""
    tree = {"data": {"families": {"kv": 0.5}, "shuffle": True}}
    assert sorted(_flatten(tree, {"data"})) == [("data.families", {"kv": 0.5}), ("data.shuffle", True)]


def test_docs_table_mirrors_the_rules():
    text = (REPO / "docs/training.md").read_text()
    section = text[text.index("## Resuming with a changed config") :]
    rows = re.findall(r"^\| (`.+?`(?:, `.+?`)*) \| (refused|warned|silent) \| (.+?) \|$", section, re.MULTILINE)
    assert rows == [(", ".join(f"`{k}`" for k in rule.keys), rule.kind, rule.why) for rule in RULES]

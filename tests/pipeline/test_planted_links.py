"""A link planted at any name the trainer, its export or eval write is refused with one line, never written through.

The names are not a hand list: a real training run and a real eval run first show which files they write, and
each of those names is then planted (a symbolic link to a file outside, or a hard link to it) before a second
run. ``tests/test_safe_writes.py`` holds the code to the same rule for the writes no run here reaches.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from data_prep.safe_write import UnsafeWriteError
from model import load_pretrained
from pipeline.cli.eval import main as eval_main
from pipeline.data.reader import read_tokenizer
from pipeline.train.export import write_export
from pipeline.train.trainer import main as train_main

VICTIM_TEXT = "someone else's file\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data, overrides):
    """One finished run (with its eval export) and the top-level names and export names it wrote."""
    run = tmp_path_factory.mktemp("planted") / "run"
    assert train_main(None, overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.every": 0})) == 0
    top = sorted(p.name for p in run.iterdir() if p.is_file())
    export = sorted(p.name for p in (run / "export").iterdir())
    return run, top, export


def _plant(path: Path, victim: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        path.symlink_to(victim)
    else:
        os.link(victim, path)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_runs_write_the_names_this_test_plants(trained):
    run, top, export = trained
    assert {"config.yaml", "metrics.jsonl", "run.lock"} <= set(top)
    assert {"config.json", "model.safetensors", "tokenizer.model", "modeling_gca.py"} <= set(export)


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_trainer_refuses_a_link_at_every_name_it_wrote(trained, tiny_data, overrides, tmp_path, caplog, kind):
    _, top, export = trained
    victim = _victim(tmp_path)
    for name in [*top, *(f"export/{n}" for n in export)]:
        run = tmp_path / f"run-{name.replace('/', '-')}"
        _plant(run / name, victim, kind)
        caplog.clear()
        code = train_main(None, overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.every": 0}))
        errors = _errors(caplog)
        assert code == 2, name
        assert len(errors) == 1 and str(run / name) in errors[0], (name, errors)
        assert ("symbolic link" if kind == "symlink" else "hard link") in errors[0]
        assert victim.read_text() == VICTIM_TEXT, name
        assert not (run / "checkpoints").exists(), name  # refused before any step


def test_export_writer_refuses_a_link_at_each_name_of_an_export(trained, tiny_data, tmp_path):
    """The writer itself, not only the trainer's check before work: an export written into a folder where one of
    its names is a link stops at that name, whichever it is, and writes nothing through it."""
    run, _, export = trained
    model = load_pretrained(run / "export")
    tokenizer = read_tokenizer(str(tiny_data))
    victim = _victim(tmp_path)
    for name in export:
        directory = tmp_path / f"export-{name}"
        _plant(directory / name, victim, "symlink")
        with pytest.raises(UnsafeWriteError, match=re.escape(str(directory / name))):
            write_export(model, directory, step=1, seq_len=64, tokenizer=tokenizer)
        assert victim.read_text() == VICTIM_TEXT, name


def test_eval_refuses_a_link_at_every_name_it_wrote_before_any_work(trained, tmp_path, capsys):
    run, _, _ = trained
    args = ["--checkpoint", str(run / "export"), "--task", "passkey"]
    settings = ["lengths=[400]", "depths=[0.5]", "samples=1", "segment=100", "progress=false"]
    first = tmp_path / "first"
    assert eval_main([*args, "--out", str(first), *settings]) == 0
    names = sorted(p.name for p in first.iterdir())
    assert {"passkey.json", "passkey.png", "passkey.samples.jsonl"} <= set(names)
    victim = _victim(tmp_path)
    for name in names:
        out = tmp_path / f"out-{name}"
        _plant(out / name, victim, "symlink")
        capsys.readouterr()
        assert eval_main([*args, "--out", str(out), *settings]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(out / name) in err[0] and "symbolic link" in err[0], (name, err)
        assert victim.read_text() == VICTIM_TEXT
        assert sorted(p.name for p in out.iterdir()) == [name]  # nothing else written: refused before the work


def test_a_link_planted_after_the_start_check_is_still_one_line(
    trained, tiny_data, overrides, tmp_path, caplog, monkeypatch
):
    """A name planted between the start check and its first write (simulated by skipping the check) is refused by
    the writer itself: one line naming it and where a relaunch resumes, exit 2, nothing written through."""
    import pipeline.train.trainer as trainer

    monkeypatch.setattr(trainer, "check_run_files", lambda run_dir: None)
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    _plant(run / "metrics.jsonl", victim, "symlink")
    caplog.clear()
    assert train_main(None, overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.every": 0})) == 2
    errors = _errors(caplog)
    assert len(errors) == 1 and str(run / "metrics.jsonl") in errors[0] and "relaunch" in errors[0], errors
    assert victim.read_text() == VICTIM_TEXT

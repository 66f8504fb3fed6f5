"""Hostile checkpoint files, resealed: a JSON file of the newest checkpoint edited and its integrity manifest
recomputed to match (as someone who can write the run directory would), or the manifest itself rewritten.

Every such file is read through ``data_prep.json_file`` and each field checked: with the defaults the damaged
checkpoint is set aside with one warning line naming the file and the field, and the run resumes from the older
intact one and ends exactly as a run that never had the damaged one; with ``checkpoint.fallback_to_previous=false``
it stops with exit 2 and one line naming the file and the field. One prepared run (checkpoints at steps 4 and 8)
is copied for each case.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from reliability_harness import assert_same_checkpoint, assert_same_steps, committed, overrides

from data_prep.json_file import JsonFileError
from pipeline.train import dist
from pipeline.train.checkpoint import INTEGRITY_FILE, OWNER_FILE, TRAINER_STATE, write_integrity
from pipeline.train.resume_check import config_changes
from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability

ONE_RANK = dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
OLDER, NEWEST, LAST = "step_00000004", "step_00000008", "step_00000012"
MAX_LINE = 3000
"""A warning or error line about a hostile file stays readable, whatever the file holds (20,000 names: 2.48 MB
before the cap)."""


def _resume_args(run: Path, data: Path, *extra: str) -> list[str]:
    return [*overrides(run, data, **{"train.max_steps": 12}), *extra]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, data) -> Path:
    """8 steps with checkpoints at 4 and 8; never modified (each test crafts a copy)."""
    run = tmp_path_factory.mktemp("hostile_ckpt") / "run"
    assert main(None, overrides(run, data)) == 0
    assert committed(run) == [OLDER, NEWEST]
    return run


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory, data) -> Path:
    """The same run resumed from step 4 to step 12 as if step 8 had never been saved."""
    run = Path(shutil.copytree(prepared, tmp_path_factory.mktemp("reference") / "run"))
    shutil.rmtree(run / "checkpoints" / NEWEST)
    assert main(None, _resume_args(run, data)) == 0
    return run


def _copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "run"))


def _edit_state(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    """Rewrite the newest checkpoint's trainer state (``change`` edits the dict, or returns a whole other value),
    then reseal its manifest."""

    def craft(ckpt: Path) -> None:
        path = ckpt / TRAINER_STATE
        state = json.loads(path.read_text())
        replaced = change(state)
        path.write_text(json.dumps(state if replaced is None else replaced))
        write_integrity(ckpt, ONE_RANK)

    return craft


def _edit_manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Rewrite the newest checkpoint's integrity manifest (the file that is not itself hashed)."""

    def craft(ckpt: Path) -> None:
        path = ckpt / INTEGRITY_FILE
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))

    return craft


def _string_entries(manifest: dict[str, Any]) -> None:
    manifest["files"] = {name: entry["sha256"] for name, entry in manifest["files"].items()}


def _many_missing(manifest: dict[str, Any]) -> None:
    entry = {"sha256": "0" * 64, "bytes": 1}
    manifest["files"].update({f"shard_{i:05d}.pt": entry for i in range(20_000)})


_STATE = rf"{NEWEST}/{TRAINER_STATE}: "
_MANIFEST = rf"{NEWEST}/{INTEGRITY_FILE}: "

CRAFTED: dict[str, tuple[Callable[[Path], None], str]] = {
    "step_1e30": (
        _edit_state(lambda s: s.update(step=10**30)),
        _STATE + r"field 'step' is 1000000000000000000000000000000, expected an integer in \[0, 1000000000000\]",
    ),
    "step_negative": (
        _edit_state(lambda s: s.update(step=-3)),
        _STATE + r"field 'step' is -3, expected an integer in \[0, ",
    ),
    "step_string": (_edit_state(lambda s: s.update(step="4")), _STATE + r"field 'step' is \"4\", expected an integer"),
    "step_of_another_directory": (
        _edit_state(lambda s: s.update(step=4)),
        _STATE + rf"field 'step' is 4, but the checkpoint's directory is {NEWEST}",
    ),
    "parallel_null": (
        _edit_state(lambda s: s.update(parallel=None)),
        _STATE + r"field 'parallel' is null, expected an object",
    ),
    "state_a_list": (_edit_state(lambda s: [s]), _STATE + r"the file is a list, expected an object"),
    "data_order_unknown": (
        _edit_state(lambda s: s["data"].update(order="random")),
        _STATE + r"field 'data\.order' is \"random\", expected one of blocks",
    ),
    "data_taken_negative": (
        _edit_state(lambda s: s["data"].update(taken=-1)),
        _STATE + r"field 'data\.taken' is -1, expected an integer in \[0, ",
    ),
    "data_seq_len_of_another_run": (
        _edit_state(lambda s: s["data"].update(seq_len=2 * s["data"]["seq_len"])),
        _STATE + r"field 'data\.seq_len' is \d+, but the config it was saved with gives \d+",
    ),
    "config_yaml_a_list": (
        _edit_state(lambda s: s.update(config_yaml="[1, 2]\n")),
        _STATE + r"field 'config_yaml' is not a recorded config \(not a mapping\)",
    ),
    "files_null": (
        _edit_manifest(lambda m: m.update(files=None)),
        _MANIFEST + r"field 'files' is null, expected an object",
    ),
    "files_a_list": (
        _edit_manifest(lambda m: m.update(files=list(m["files"]))),
        _MANIFEST + r"field 'files' is \[\"OWNER\.json\", .*, expected an object",
    ),
    "files_string_entries": (
        _edit_manifest(_string_entries),
        _MANIFEST + r"field 'files\.OWNER\.json' is \"[0-9a-f]+\.\.\., expected an object",
    ),
    "files_20000_missing": (
        _edit_manifest(_many_missing),
        rf"{NEWEST}/shard_00000\.pt: listed in {INTEGRITY_FILE} but missing, .* and 19,990 more$",
    ),
}


def _lines(caplog: pytest.LogCaptureFixture, level: int, contains: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and contains in r.getMessage()]


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_resealed_hostile_file_is_set_aside_and_the_older_checkpoint_resumed(
    case, prepared, reference, data, tmp_path, caplog
):
    """By default: one warning line naming the file and the field; the run resumes from step 4, the crafted
    checkpoint kept aside, and ends bitwise equal to a run that never had it."""
    craft, message = CRAFTED[case]
    run = _copy(prepared, tmp_path)
    craft(run / "checkpoints" / NEWEST)
    with caplog.at_level(logging.WARNING):
        assert main(None, _resume_args(run, data)) == 0
    [warning] = _lines(caplog, logging.WARNING, "not resuming from")
    assert re.search(message, warning.split("; set aside as")[0]), warning
    assert "\n" not in warning and len(warning) < MAX_LINE, len(warning)
    assert f"resuming from {run / 'checkpoints' / OLDER} (step 4)" in warning
    assert _lines(caplog, logging.ERROR) == []
    assert committed(run) == [OLDER, NEWEST, f"{NEWEST}.rejected", LAST], "step 8 saved again, the crafted one aside"
    assert_same_steps(reference, run, range(5, 13))
    assert_same_checkpoint(reference / "checkpoints" / LAST, run / "checkpoints" / LAST)


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_resealed_hostile_file_without_fallback_stops_naming_file_and_field(case, prepared, data, tmp_path, caplog):
    """checkpoint.fallback_to_previous=false: exit 2 and one error line naming the file and the field; nothing is
    moved."""
    craft, message = CRAFTED[case]
    run = _copy(prepared, tmp_path)
    craft(run / "checkpoints" / NEWEST)
    with caplog.at_level(logging.WARNING):
        assert main(None, _resume_args(run, data, "checkpoint.fallback_to_previous=false")) == 2
    [error] = _lines(caplog, logging.ERROR)
    assert error.startswith("checkpoint error: ") and re.search(message, error.split("; nothing was loaded")[0]), error
    assert "\n" not in error and len(error) < MAX_LINE, len(error)
    assert committed(run) == [OLDER, NEWEST]


def test_malformed_owner_file_makes_a_checkpoint_foreign_not_a_traceback(prepared, data, tmp_path):
    """An ``OWNER.json`` nested 100,000 deep (resealed) in the older checkpoint: each prune reads it, finds the
    checkpoint not provably this trainer's, and leaves it alone; the run trains on from step 8."""
    run = _copy(prepared, tmp_path)
    older = run / "checkpoints" / OLDER
    (older / OWNER_FILE).write_text("[" * 100_000 + "]" * 100_000)
    write_integrity(older, ONE_RANK)
    assert main(None, [*_resume_args(run, data), "checkpoint.keep_last=1"]) == 0
    assert committed(run) == [OLDER, LAST], "the checkpoint with the malformed owner file is never deleted"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("[1, 2]\n", r"not a mapping"),
        ("train: [\n", r"while parsing"),
        ("train: 5\n", r"section train is not a mapping"),
        ("seed: !!binary aGVsbG8=\n", r"not JSON serializable"),
        ("seed: &x 1\nrun_dir: *x\n", r"uses YAML aliases"),
    ],
)
def test_a_recorded_config_of_another_shape_is_refused_naming_the_field(text, reason):
    """The ``config_yaml`` a resume compares is parsed as untrusted text: anything `config_record` would not write
    (another top-level shape, broken YAML, a section that is not a mapping, values that are not plain data, aliases,
    which OmegaConf copies at each use) is a `JsonFileError` naming the field, which the resume takes as a damaged
    checkpoint (the case config_yaml_a_list above)."""
    where = "ckpt/trainer_state.json: field 'config_yaml'"
    with pytest.raises(JsonFileError, match=rf"^{re.escape(where)} is not a recorded config \(.*{reason}"):
        config_changes(text, "run_dir: r\n", where)


def test_a_recorded_learning_rate_that_is_no_number_is_stated_as_unknown(prepared, data, tmp_path, caplog):
    """A recorded config of the right shape whose schedule inputs are no numbers (resealed): the resume goes on
    from step 8, its warning block stating the old learning rate as unknown."""
    run = _copy(prepared, tmp_path)

    def strange_schedule(state: dict[str, Any]) -> None:
        config = yaml.safe_load(state["config_yaml"])
        config["optim"]["lr"], config["schedule"]["decay"] = "fast", "constant"
        state["config_yaml"] = yaml.safe_dump(config)

    _edit_state(strange_schedule)(run / "checkpoints" / NEWEST)
    with caplog.at_level(logging.WARNING):
        assert main(None, _resume_args(run, data)) == 0
    assert "learning rate at step 9: unknown (a value it needs came from the environment or is not a number)" in (
        caplog.text
    )
    assert committed(run) == [OLDER, NEWEST, LAST]

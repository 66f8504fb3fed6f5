"""A manifest whose counts disagree with the splits it describes is refused before any work (issue 62, item 4).

``_COMPLETE`` seals ``manifest.json`` against an interrupted prep, not against an edit: resealing an edited
manifest is one sha256 away. So its counts are held against the split's ``index.json``
(``data_prep.format.split_count_mismatch``), by the trainer and by preflight alike.
"""

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import prepared_copy

from data_prep import format as fmt
from pipeline.train import preflight
from pipeline.train.trainer import main

REPO = Path(__file__).resolve().parents[2]
FAST = {"train.max_steps": 3, "checkpoint.every": 3, "train.eval_every": 1, "train.eval_batches": 1}


def reseal(root: Path, token_dtype: str | None = None, **splits: dict[str, Any]) -> fmt.Manifest:
    """Edit the counts of ``root``'s manifest (``train={"tokens": ...}``) and reseal it as data prep seals it
    (`data_prep.shard.commit_dataset`): ``_COMPLETE`` holds the sha256 of the new bytes, so it reads as complete."""
    manifest = fmt.read_manifest(root)
    edited = {name: dataclasses.replace(manifest.splits[name], **fields) for name, fields in splits.items()}
    manifest = dataclasses.replace(
        manifest, splits={**manifest.splits, **edited}, token_dtype=token_dtype or manifest.token_dtype
    )
    data = manifest.to_json().encode()
    (root / fmt.MANIFEST_FILENAME).write_bytes(data)
    (root / fmt.COMPLETE_MARKER).write_bytes((hashlib.sha256(data).hexdigest() + "\n").encode())
    assert fmt.read_manifest(root) == manifest  # sealed: read_manifest alone cannot tell
    return manifest


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_untouched_prepared_dataset_trains(tmp_path, tiny_data, overrides):
    data = prepared_copy(tmp_path, tiny_data)
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **FAST)) == 0
    assert (run / "checkpoints" / "step_00000003" / "COMMITTED").is_file()
    assert preflight.check_data(str(data), "train", 64, val_split="val") == []


def test_tokens_claimed_100x_and_1e9_val_tokens_are_refused_before_any_step(tmp_path, tiny_data, overrides, caplog):
    data = prepared_copy(tmp_path, tiny_data)
    true = fmt.read_manifest(data).splits
    claimed = true["train"].tokens * 100
    reseal(data, train={"tokens": claimed}, val={"tokens": 10**9})
    run = tmp_path / "run"

    assert main(None, overrides(run, data, **FAST)) == 2

    [line] = errors(caplog)
    assert f"{data / 'manifest.json'} records splits.train.tokens={claimed}, but the " in line, line
    low, high = (int(n) for n in line.split(" hold ")[1].split(" tokens")[0].split(" to "))
    assert low <= true["train"].tokens <= high < claimed, line  # the data's own count, within the shards' range
    assert high - low <= 3 * true["train"].pieces // 2, "uint16 ids: at most 1.5 tokens of slack per piece"
    assert not run.exists(), "refused before the run directory, a step or a checkpoint"


def test_val_tokens_alone_are_refused_when_validation_reads_val(tmp_path, tiny_data, overrides, caplog):
    data = prepared_copy(tmp_path, tiny_data)
    reseal(data, val={"tokens": 10**9})
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **FAST)) == 2
    [line] = errors(caplog)
    assert "(data.val_split=val)" in line and "records splits.val.tokens=1000000000, but the " in line, line
    assert not run.exists()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ({"train": {"pieces": 7}}, "records splits.train.pieces=7, but {index} lists {pieces} samples"),
        ({"train": {"documents": 10**6}}, "records splits.train.documents=1000000, but {index} lists {pieces} samples"),
        ({"train": {"documents": 0}}, "records splits.train.documents=0, but {index} lists {pieces} samples"),
        ({"train": {"tokens": 1}}, "records splits.train.tokens=1, but the "),
        ({"token_dtype": "uint32"}, "records token_dtype=uint32, but {index} lists shards of uint16"),
    ],
    ids=["pieces", "documents-above-pieces", "no-documents", "tokens-below", "token-dtype"],
)
def test_each_checked_count_is_refused_by_trainer_and_preflight(edit, expected, tmp_path, tiny_data, overrides, caplog):
    data = prepared_copy(tmp_path, tiny_data)
    pieces = fmt.read_manifest(data).splits["train"].pieces
    reseal(data, **edit)
    expected = expected.format(index=data / "train" / "index.json", pieces=pieces)
    run = tmp_path / "run"

    assert main(None, overrides(run, data, **FAST)) == 2
    [line] = errors(caplog)
    assert f"{data / 'manifest.json'} {expected}" in line, line
    assert not run.exists()

    [line] = preflight.check_data(str(data), "train", 64)
    assert line.startswith(f"data: {data / 'manifest.json'} {expected}"), line


def test_launch_pretrain_exits_2_with_one_line(tmp_path, tiny_data, overrides):
    """The real entry (``launch/pretrain.py`` with configs/train/debug.yaml): exit 2, one error line, nothing run."""
    data = prepared_copy(tmp_path, tiny_data)
    claimed = fmt.read_manifest(data).splits["train"].tokens * 100
    reseal(data, train={"tokens": claimed}, val={"tokens": 10**9})
    run = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "launch/pretrain.py"), "--config", str(REPO / "configs/train/debug.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *overrides(run, data)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "ERROR" in line]
    assert len(lines) == 1 and f"records splits.train.tokens={claimed}, but the " in lines[0], lines
    assert not run.exists()

"""Inputs someone edited and resealed are refused before any work, with one line naming the file (issue 64,
findings 1, 6 and 7).

"Resealed": the hashes that guard a file recomputed to match, so those checks pass. ``manifest.json`` records the
tokenizer's sha256 and the split index's; ``_COMPLETE`` records the manifest's. A dense ``hf:`` folder has no seal
at all. So the trainer's start check (``pipeline.train.inputs.check_inputs``) holds the tokenizer to the manifest,
parses every index with bounds and field checks, stats (never reads) the shards an index lists, and checks a dense
checkpoint's ``model.safetensors.index.json`` before any file it names is opened.
"""

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import prepared_copy
from helpers import save_tiny_dense, tiny_config, train_test_tokenizer

from data_prep import format as fmt
from model import build_model, save_pretrained
from pipeline.evaluation.runtime import load_checkpoint
from pipeline.train import preflight
from pipeline.train.trainer import main

FAST = {"train.max_steps": 3, "checkpoint.every": 3, "train.eval_every": 1, "train.eval_batches": 1}
CONVERTED = {
    "model.position": "rope",
    "model.tokens_see_landmarks": False,
    "model.norm_eps": 1e-6,
    "model.rope_theta": 10000.0,
}
"""What the tiny dense checkpoint dictates on top of the tests' tiny model (as tests/pipeline/test_convert_train.py)."""


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def refused(main_args: list[str], run: Path, caplog: pytest.LogCaptureFixture) -> str:
    """The trainer's one error line for ``main_args``: exit 2, before the run directory is written."""
    assert main(None, main_args) == 2
    [line] = errors(caplog)
    assert "\n" not in line and len(line) < 600, line
    assert not run.exists(), "refused before the run directory, a step or a checkpoint"
    return line


# -- finding 1: the tokenizer beside the splits is the one the manifest records ----------------------------------


@pytest.fixture(scope="module")
def foreign_tokenizer() -> bytes:
    """Another SentencePiece model of the same size (64 pieces): the vocabulary check alone cannot tell."""
    lines = [f"{i} an entirely different corpus of words number {i * 7}" for i in range(300)]
    return train_test_tokenizer(lines, 64, byte_fallback=False, eos_id=1)


@pytest.mark.parametrize("swap", ["another-model", "empty"])
def test_a_swapped_or_empty_tokenizer_is_refused_with_both_hashes(
    swap, tmp_path, tiny_data, overrides, caplog, foreign_tokenizer
):
    data = prepared_copy(tmp_path, tiny_data)
    recorded = fmt.read_manifest(data).tokenizer.sha256
    planted = foreign_tokenizer if swap == "another-model" else b""
    (data / fmt.TOKENIZER_FILENAME).write_bytes(planted)
    run = tmp_path / "run"

    line = refused(overrides(run, data, **FAST), run, caplog)
    found = hashlib.sha256(planted).hexdigest()
    assert (
        f"{data / fmt.TOKENIZER_FILENAME} has sha256 {found}, but {data / 'manifest.json'} records {recorded}" in line
    )

    [line] = preflight.check_data(str(data), "train", 64)
    assert line.startswith(f"data: {data / fmt.TOKENIZER_FILENAME} has sha256 {found}, but "), line


def test_an_empty_tokenizer_in_an_export_is_one_line_when_loaded(tmp_path):
    """Before: the export loaded, and eval failed at its first prompt with ``Model is not initialized``."""
    model = build_model(tiny_config(vocab_size=64))
    export = save_pretrained(model, tmp_path / "export", extra={"tokenizer": fmt.TOKENIZER_FILENAME})
    (export / fmt.TOKENIZER_FILENAME).write_bytes(b"")
    with pytest.raises(ValueError) as info:
        load_checkpoint(export)
    line = str(info.value)
    assert line.startswith(f"{export / fmt.TOKENIZER_FILENAME}: tokenizer.model is not a SentencePiece model"), line
    assert "\n" not in line
    (export / fmt.TOKENIZER_FILENAME).unlink()
    os.mkfifo(export / fmt.TOKENIZER_FILENAME)  # before: reported as a file that "does not exist"
    with pytest.raises(ValueError, match=rf"^{export / fmt.TOKENIZER_FILENAME}: .* is a FIFO, not a regular file"):
        load_checkpoint(export)


# -- finding 6: a dense hf: folder's shard index --------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return save_tiny_dense(tmp_path_factory.mktemp("dense") / "llama", tied=True)


def sharded_copy(dense_dir: Path, folder: Path) -> tuple[Path, dict[str, str]]:
    """A copy of ``dense_dir`` whose weights are listed in a ``model.safetensors.index.json`` (as a sharded
    checkpoint is); returns the folder and its weight map."""
    from safetensors import safe_open

    shutil.copytree(dense_dir, folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}
    return folder, weight_map


def write_index(folder: Path, weight_map: dict[str, object]) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_a_sharded_dense_checkpoint_still_starts(tmp_path, tiny_data, overrides, dense_dir):
    from pipeline.train.config import load_config
    from pipeline.train.inputs import check_inputs

    folder, weight_map = sharded_copy(dense_dir, tmp_path / "dense")
    write_index(folder, weight_map)
    check_inputs(
        load_config(
            None, overrides(tmp_path / "run", tiny_data, **CONVERTED, **{"checkpoint.init_from": f"hf:{folder}"})
        )
    )


@pytest.mark.parametrize("entry", ["null", "list", "outside", "fifo"])
def test_a_hostile_weight_map_entry_is_refused_before_any_file_it_names_is_opened(
    entry, tmp_path, tiny_data, overrides, dense_dir, caplog, monkeypatch
):
    import model.convert

    folder, weight_map = sharded_copy(dense_dir, tmp_path / "dense")
    outside = tmp_path / "outside" / "w.safetensors"
    outside.parent.mkdir()
    shutil.copy(folder / "model.safetensors", outside)  # a valid file: before, it was read and the run trained
    os.mkfifo(folder / "w.safetensors")
    tensor = "model.norm.weight"
    weight_map[tensor] = {
        "null": None,
        "list": ["model.safetensors"],
        "outside": "../outside/w.safetensors",
        "fifo": "w.safetensors",
    }[entry]
    index = write_index(folder, weight_map)
    opened: list[Path] = []
    checked = model.convert.check_safetensors
    monkeypatch.setattr(model.convert, "check_safetensors", lambda path: opened.append(Path(path)) or checked(path))
    run = tmp_path / "run"

    started = time.perf_counter()
    line = refused(overrides(run, tiny_data, **CONVERTED, **{"checkpoint.init_from": f"hf:{folder}"}), run, caplog)
    assert time.perf_counter() - started < 60, "refused at the start, never blocked on the FIFO"
    assert f"{index}: weight_map entry '{tensor}' names " in line, line
    expected = "which is not a regular file" if entry == "fifo" else "not a file name inside"
    assert expected in line, line
    assert opened == [], "no weight file is opened before the whole index passed"


def test_an_unreadable_tokenizer_in_a_dense_folder_is_one_line(tmp_path, tiny_data, overrides, dense_dir, caplog):
    """Before: a FIFO named tokenizer.model was taken for no tokenizer at all, and the check was skipped."""
    folder = tmp_path / "dense"
    shutil.copytree(dense_dir, folder)
    os.mkfifo(folder / fmt.TOKENIZER_FILENAME)
    run = tmp_path / "run"
    line = refused(overrides(run, tiny_data, **CONVERTED, **{"checkpoint.init_from": f"hf:{folder}"}), run, caplog)
    assert f"{folder / fmt.TOKENIZER_FILENAME} is a FIFO, not a regular file" in line, line


# -- finding 7: a resealed index.json -------------------------------------------------------------------------


def reseal_index(data: Path, split: str, raw: bytes, **counts: int) -> Path:
    """Write ``raw`` as ``data/split/index.json`` and reseal: the manifest records its sha256 (and ``counts``), and
    ``_COMPLETE`` the manifest's, so every hash check passes."""
    index = data / split / "index.json"
    index.write_bytes(raw)
    manifest = json.loads((data / fmt.MANIFEST_FILENAME).read_text())
    manifest["splits"][split].update(index_sha256=hashlib.sha256(raw).hexdigest(), **counts)
    text = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (data / fmt.MANIFEST_FILENAME).write_bytes(text)
    (data / fmt.COMPLETE_MARKER).write_text(hashlib.sha256(text).hexdigest() + "\n")
    fmt.read_manifest(data)  # sealed: read_manifest alone cannot tell
    return index


def test_200000_deep_nesting_and_a_count_of_1e30_are_one_line(tmp_path, tiny_data, overrides, caplog):
    data = prepared_copy(tmp_path, tiny_data)
    original = (data / "train" / "index.json").read_text()
    run = tmp_path / "run"
    index = reseal_index(data, "train", b"[" * 200_000 + b"]" * 200_000)
    line = refused(overrides(run, data, **FAST), run, caplog)
    assert f"{index}: JSON nested 200000 deep (at most 32 is read)" in line, line

    caplog.clear()
    samples = json.loads(original)["shards"][0]["samples"]
    reseal_index(data, "train", original.replace(f'"samples": {samples}', '"samples": 1e30', 1).encode())
    line = refused(overrides(run, data, **FAST), run, caplog)
    assert f"{index}: field 'shards[0].samples' is 1e+30, expected an integer in [0, 4294967295]" in line, line


def test_100000_missing_shards_are_found_in_seconds_by_stat_alone(tmp_path, tiny_data, overrides, caplog):
    """Before: 17 s and 814 MiB of readers, then a FileNotFoundError naming one shard and neither the dataset nor
    the index."""
    data = prepared_copy(tmp_path, tiny_data)
    stats = fmt.read_manifest(data).splits["train"]
    shards = json.loads((data / "train" / "index.json").read_text())["shards"]
    copies = -(-100_000 // len(shards))
    listed = []
    for n in range(copies):  # the real shards again and again under new names: the counts stay consistent
        for shard in shards:
            files = {
                key: {**shard[key], "basename": f"{n:06d}.{shard[key]['basename']}"} for key in ("raw_data", "zip_data")
            }
            listed.append({**shard, **files})
    raw = json.dumps({"shards": listed, "version": 2}).encode()
    index = reseal_index(data, "train", raw, pieces=stats.pieces * copies, tokens=stats.tokens * copies)
    run = tmp_path / "run"

    started = time.perf_counter()
    line = refused(overrides(run, data, **FAST), run, caplog)
    elapsed = time.perf_counter() - started
    assert (
        f"data.path={data} (data.train_split=train): {index} lists {len(listed):,} shard(s) whose "
        "files are missing (or not regular files): 000000.shard.00000.mds, "
    ) in line, line
    assert line.endswith("more; re-run data prep, or restore the split it wrote"), line
    assert elapsed < 20, f"{elapsed:.1f} s"

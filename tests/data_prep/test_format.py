"""`data_prep.format.read_manifest`: the one reader of manifest.json and _COMPLETE for the trainer, preflight,
eval and the merge. A dataset may come from someone else, so neither file is read through a link or from a FIFO."""

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from data_prep.format import (
    COMPLETE_MARKER,
    EMPTY_SPLIT_SHA256,
    FORMAT_VERSION,
    MANIFEST_FILENAME,
    IncompleteDatasetError,
    Manifest,
    SplitStats,
    TokenizerInfo,
    read_manifest,
)
from data_prep.safe_files import UnsafeDatasetError

_TOKENIZER = TokenizerInfo(
    sha256="ab" * 32, vocab_size=400, model_type="bpe", trained=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1
)
_MANIFEST = Manifest(
    format_version=FORMAT_VERSION,
    token_dtype="uint16",
    tokenizer=_TOKENIZER,
    splits={"train": SplitStats(3, 4, 500, "cd" * 32), "val": SplitStats(0, 0, 0, EMPTY_SPLIT_SHA256)},
    skipped={"empty": 1},
    inputs=[],
    config={"output": "x"},
)


def _write(root: Path, data: bytes) -> None:
    """A dataset directory holding ``data`` as manifest.json and its sha256 as the marker, as prep writes them."""
    root.mkdir(exist_ok=True)
    (root / MANIFEST_FILENAME).write_bytes(data)
    (root / COMPLETE_MARKER).write_text(hashlib.sha256(data).hexdigest() + "\n")


def _within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` in a daemon thread; the exception it raised (None if none). Fails if it is still blocked
    after ``seconds`` (a read of a FIFO without a writer never returns)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # handed to the test, which checks the type
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


def test_round_trip(tmp_path):
    _write(tmp_path / "ds", _MANIFEST.to_json().encode())
    assert read_manifest(tmp_path / "ds") == _MANIFEST
    assert not read_manifest(tmp_path / "ds").has_split("val")


@pytest.mark.parametrize("name", [MANIFEST_FILENAME, COMPLETE_MARKER])
def test_a_symlinked_file_is_refused_in_one_line(name, tmp_path):
    """A link to a valid copy elsewhere: following it would read any file of the user; it is refused by name."""
    _write(tmp_path / "elsewhere", _MANIFEST.to_json().encode())
    _write(tmp_path / "ds", _MANIFEST.to_json().encode())
    (tmp_path / "ds" / name).unlink()
    (tmp_path / "ds" / name).symlink_to(tmp_path / "elsewhere" / name)
    with pytest.raises(UnsafeDatasetError) as err:
        read_manifest(tmp_path / "ds")
    assert str(err.value).startswith(f"{tmp_path / 'ds' / name} is a symbolic link, not a regular file")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", [MANIFEST_FILENAME, COMPLETE_MARKER])
def test_a_fifo_is_refused_without_blocking(name, tmp_path):
    _write(tmp_path / "ds", _MANIFEST.to_json().encode())
    (tmp_path / "ds" / name).unlink()
    os.mkfifo(tmp_path / "ds" / name)
    err = _within(10, lambda: read_manifest(tmp_path / "ds"))
    assert isinstance(err, UnsafeDatasetError) and str(err).startswith(f"{tmp_path / 'ds' / name} is a FIFO"), err


def test_missing_or_mismatched_files_are_an_incomplete_dataset(tmp_path):
    with pytest.raises(IncompleteDatasetError, match=f"{tmp_path / 'none'} is not a completed prepared dataset"):
        read_manifest(tmp_path / "none")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(IncompleteDatasetError, match="is not a completed prepared dataset"):
        read_manifest(tmp_path / "file")
    _write(tmp_path / "ds", _MANIFEST.to_json().encode())
    (tmp_path / "ds" / COMPLETE_MARKER).unlink()
    with pytest.raises(IncompleteDatasetError, match=f"no {COMPLETE_MARKER} or {MANIFEST_FILENAME}"):
        read_manifest(tmp_path / "ds")
    _write(tmp_path / "ds", _MANIFEST.to_json().encode())
    (tmp_path / "ds" / MANIFEST_FILENAME).write_text(_MANIFEST.to_json().replace('"uint16"', '"uint32"'))
    with pytest.raises(IncompleteDatasetError, match="does not match .* the dataset was modified after it was"):
        read_manifest(tmp_path / "ds")


def test_a_marked_manifest_that_is_not_json_is_one_line(tmp_path):
    _write(tmp_path / "ds", b"{not json")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'ds' / MANIFEST_FILENAME}: not valid JSON \(.*\); re-run"):
        read_manifest(tmp_path / "ds")

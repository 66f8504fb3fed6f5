"""The resumable stage runner of the demos: skip what is done, time what runs, name what fails."""

from __future__ import annotations

import json
import sys

import pytest

from pipeline.demos.runner import StageError, StageRunner


def _touch(path) -> list[str]:
    return [sys.executable, "-c", f"open({str(path)!r}, 'w').write('x')"]


def test_a_stage_runs_once_and_its_time_is_kept(tmp_path):
    done = tmp_path / "out.txt"
    runner = StageRunner(tmp_path / "run", tmp_path)
    runner.run("make", _touch(done), done)
    assert done.read_text() == "x"
    done.write_text("kept")
    again = StageRunner(tmp_path / "run", tmp_path)  # a rerun of the job: the stage is skipped
    again.run("make", _touch(done), done)
    assert done.read_text() == "kept"
    timings = json.loads((tmp_path / "run" / "timings.json").read_text())
    assert list(timings) == ["make"] and timings["make"] >= 0 and again.timings == timings


def test_a_failed_stage_is_named_with_its_command(tmp_path):
    runner = StageRunner(tmp_path / "run", tmp_path)
    with pytest.raises(StageError, match=r"stage 'boom' failed with exit code 3: .*SystemExit\(3\)"):
        runner.run("boom", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "never")
    with pytest.raises(StageError, match=r"stage 'quiet' finished but did not produce .*never"):
        runner.run("quiet", [sys.executable, "-c", "pass"], tmp_path / "never")
    assert runner.timings == {}

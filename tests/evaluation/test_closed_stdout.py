"""Output into a closed pipe or a full device (issue 64, finding 12), through the one handler every command line
goes through (``data_prep.entry.run``): a closed pipe ends the command quietly with 141 (128 + SIGPIPE, as a shell
reports it), a full device is one line on stderr naming standard output and the error, exit 1; never a traceback,
never exit 0 with the output lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.entry import CLOSED_PIPE_EXIT

REPO = Path(__file__).resolve().parents[2]
COMMANDS = {
    "eval": lambda export, out: [
        "launch/eval.py",
        *("--checkpoint", str(export), "--task", "passkey", "--out", str(out)),
        *("lengths=[300]", "depths=[0.5]", "samples=1", "progress=false"),
    ],
    # Long enough that the pipe closes while tokens are still streamed, one write each.
    "generate": lambda export, out: [
        "launch/generate.py",
        *("--checkpoint", str(export), "--prompt", "Once upon", "--max-new-tokens", "4000"),
    ],
    "prep": lambda export, out: ["launch/prep.py", "--keys"],
}


def _start(command: str, tiny_export: Path, tmp_path: Path, stdout: int) -> subprocess.Popen:
    cmd = [sys.executable, *COMMANDS[command](tiny_export, tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)


def _clean(stderr: str) -> None:
    for sign in ("Traceback", "Exception ignored", "BrokenPipeError"):
        assert sign not in stderr, stderr[-4000:]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_closed_pipe_ends_the_command_quietly(command, tiny_export, tmp_path):
    read, write = os.pipe()
    proc = _start(command, tiny_export, tmp_path, write)
    os.close(write)
    if command == "generate":
        assert os.read(read, 1)  # the reader takes one byte of the stream, then goes (``| head -c 1``)
    os.close(read)  # eval and prep print at the end: the pipe is closed before their first write
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == CLOSED_PIPE_EXIT, stderr[-4000:]
    _clean(stderr)
    assert "error:" not in stderr, stderr[-4000:]
    if command == "eval":
        assert (tmp_path / "out" / "passkey.json").is_file()  # the result itself was written


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_full_device_is_one_line_naming_standard_output(command, tiny_export, tmp_path):
    with open("/dev/full", "w") as full:
        proc = _start(command, tiny_export, tmp_path, full.fileno())
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-4000:]
    _clean(stderr)
    name = COMMANDS[command](tiny_export, tmp_path)[0].removeprefix("launch/")
    line = (
        f"{name}: error: cannot write to standard output (/dev/full): No space left on device (errno 28); what the "
        "command printed is incomplete"
    )
    assert stderr.splitlines()[-1] == line and stderr.count("error:") == 1, stderr[-4000:]


def test_every_launch_script_goes_through_the_one_handler():
    """Each ``launch/*.py`` (and the sliced prep's) ends in ``run(main)``, so each has the handling above."""
    scripts = sorted([*(REPO / "launch").glob("*.py"), REPO / "launch/slurm/prep_slices.py"])
    assert len(scripts) > 20
    for script in scripts:
        text = script.read_text(encoding="utf-8")
        assert "from data_prep.entry import run" in text and text.rstrip().endswith(")"), script
        assert 'if __name__ == "__main__":\n    run(' in text, script

"""What a shell can hand the tools (issue 64, findings 9-11), each one line and exit 2 before any work, or used:

- ``--config <(...)`` (a pipe at ``/dev/fd/63``) is read as YAML, up to a size bound; a directory, a FIFO nothing
  writes to and ``/dev/zero`` are named for what they are (they were all "config file not found");
- an override holding bytes that are not UTF-8 (``run_dir=...\\xff``) names the override (it was a
  ``UnicodeEncodeError`` traceback), and so is such a ``generate --prompt`` (a pybind11 cast error);
- a working directory removed before the command started is said (it was a bare ``FileNotFoundError``).

The tools run as a user runs them, in a subprocess; the errors come before any training, so each takes seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CONFIGS = {
    "pretrain": "configs/train/tiny.yaml",
    "prep": "configs/data/default.yaml",
    "eval": "configs/eval/ppl.yaml",
}


def _command(tool: str, config: str, out: Path) -> list[str]:
    """``tool`` with ``--config config`` and every other path absolute, under ``out``."""
    script = str(REPO / "launch" / f"{tool}.py")
    if tool == "pretrain":
        return [PYTHON, script, "--config", config, f"run_dir={out}", f"data.path={out.parent / 'no-data'}"]
    if tool == "prep":
        return [PYTHON, script, "--config", config, f"output={out}"]
    return [
        PYTHON,
        script,
        "--config",
        config,
        "--checkpoint",
        str(out.parent / "no-export"),
        "--task",
        "ppl",
        "--out",
    ] + [str(out)]


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a failed tool printed (a log line's time and logger prefix removed)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


def _bash(script: str, tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    """``script`` run by bash, with ``variables`` in its environment."""
    return subprocess.run(
        ["bash", "-c", script], env={**ENV, **variables}, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


# -- finding 9: --config from a pipe, and configs that are no file ------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "edit", "said"),
    [
        ("pretrain", "s/max_steps: 600/max_steps: 5/", "schedule.warmup_steps=30 must be < train.max_steps=5"),
        ("prep", "s/vocab_size: 4096/vocab_size: 1/", "tokenizer.vocab_size=1: must be in [300, 2**32)"),
        ("eval", "s/^lengths: \\[1024/lengths: [1/", "lengths=[1, 4096, 16384, 65536]: need at least one length"),
    ],
)
def test_a_config_from_process_substitution_is_read(tmp_path, tool, edit, said):
    """The edited value is what the error names: the pipe was read, not called missing."""
    out = tmp_path / "out"
    words = " ".join(f"'{word}'" for word in _command(tool, "CONFIG", out)).replace(
        "'CONFIG'", '<(sed "$EDIT" "$BASE")'
    )
    proc = _bash(words, tmp_path, EDIT=edit, BASE=str(REPO / CONFIGS[tool]))
    assert said in _error_line(proc)
    assert not out.exists()


def test_a_config_pipe_is_read_up_to_a_bound(tmp_path):
    proc = _bash(f"exec {_prep_words(tmp_path)} --config <(yes 'a: b')", tmp_path)
    assert _error_line(proc).endswith(": more than 16,777,216 bytes; a config file is a few keys")


def _prep_words(tmp_path: Path) -> str:
    return f"'{PYTHON}' '{REPO / 'launch/prep.py'}' 'output={tmp_path / 'out'}'"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: p.mkdir(), "a directory, not a YAML file of prep keys"),
        (
            os.mkfifo,
            "a pipe that nothing was written to within 2 s (a FIFO no program writes to, or a command that printed "
            "nothing); a config file is YAML",
        ),
        (None, "a character device, not a YAML file of prep keys"),
    ],
    ids=["directory", "fifo", "dev-zero"],
)
def test_a_config_that_is_no_file_is_named_for_what_it_is(tmp_path, make, said):
    config = tmp_path / "config.yaml"
    if make is None:
        config = Path("/dev/zero")
    else:
        make(config)
    proc = subprocess.run(_command("prep", str(config), tmp_path / "out"), env=ENV, capture_output=True, text=True)
    assert _error_line(proc) == f"prep: error: config file {config}: {said}"
    assert not (tmp_path / "out").exists()


# -- finding 10: overrides that are not UTF-8 ----------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["pretrain", "prep"])
def test_an_override_that_is_not_utf8_is_named(tmp_path, tool):
    key = "run_dir" if tool == "pretrain" else "output"
    argv = [os.fsencode(word) for word in _command(tool, str(REPO / CONFIGS[tool]), tmp_path / "out")]
    at = next(i for i, word in enumerate(argv) if word.startswith(key.encode() + b"="))
    argv[at] += b"/caf\xe9"  # Latin-1, as an old file system may name it
    proc = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    position = len(argv[at]) - 1
    assert _error_line(proc).endswith(
        f"override '{key}=...': byte 0xe9 at position {position} is not UTF-8 text; config values are UTF-8 (rename "
        "a path whose name is not)"
    )
    assert not (tmp_path / "out").exists()


def test_a_prompt_that_is_not_utf8_is_named_before_the_model_loads(tmp_path):
    """It reached the tokenizer, whose C++ binding failed to take it (a pybind11 cast error)."""
    argv = [PYTHON, str(REPO / "launch/generate.py"), "--checkpoint", str(tmp_path / "no-export")]
    proc = subprocess.run([*argv, b"--prompt", b"caf\xe9 au lait"], env=ENV, capture_output=True, text=True)
    assert _error_line(proc) == "error: --prompt: byte 0xe9 at position 3 is not UTF-8 text; give the prompt in UTF-8"


# -- finding 11: a removed working directory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "tool",
    ["pretrain", "prep", "eval"],
)
def test_a_removed_working_directory_is_said(tmp_path, tool):
    gone = tmp_path / "gone"
    gone.mkdir()
    words = " ".join(f"'{word}'" for word in _command(tool, str(REPO / CONFIGS[tool]), tmp_path / "out"))
    proc = _bash(f'cd "$GONE" && rmdir "$GONE" && exec {words}', tmp_path, GONE=str(gone))
    assert _error_line(proc).endswith(
        "the working directory no longer exists (it was removed after the shell entered it); cd to a directory that "
        "exists and run the command again"
    )
    assert not (tmp_path / "out").exists()

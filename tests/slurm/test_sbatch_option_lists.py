"""The sbatch scripts' option lists in environment variables (``PREP_SBATCH_ARGS``, ``PREFLIGHT_ARGS``) are read
as shell words. Default tier: the real scripts run under bash with stand-ins for the SLURM commands on ``PATH``
that record the arguments they were given (tests/slurm's cluster tests run them for real)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECORD = """#!/bin/bash
# Stand-in for a SLURM command: one line per call holding its arguments, each followed by a NUL byte.
printf '%s\\0' "$@" >>"$RECORD_DIR/$(basename "$0")"
printf '\\n' >>"$RECORD_DIR/$(basename "$0")"
"""


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def stubs(tmp_path: Path) -> Path:
    """``sbatch`` (prints a job id), ``squeue`` (a time limit), ``scontrol`` (one node), ``srun`` (fails, as a
    failed preflight), all recording their arguments; and a ``GCA_PYTHON`` that runs only the scripts' word
    splitter for real, standing in for the prep and training steps."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "sbatch", RECORD + "echo 42\n")
    _stub(bin_dir, "squeue", RECORD + "echo 1:00:00\n")
    _stub(bin_dir, "scontrol", RECORD + "echo node1\n")
    _stub(bin_dir, "srun", RECORD + "exit 1\n")
    _stub(bin_dir, "python", f'#!/bin/bash\n[[ $1 == */shell_words.py ]] && exec {sys.executable} "$@"\nexit 0\n')
    return bin_dir


def _run(script: str, stubs: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "RECORD_DIR": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_PARTITION": "cpu",
        "SLURM_JOB_NODELIST": "node1",
        "GCA_PYTHON": str(stubs / "python"),
        "LOG_DIR": str(tmp_path),
        **env,
    }
    return subprocess.run(
        ["bash", str(REPO / "launch" / "slurm" / script)], env=environment, capture_output=True, text=True, timeout=60
    )


def _calls(tmp_path: Path, command: str) -> list[list[str]]:
    lines = (tmp_path / command).read_text().split("\n")[:-1]
    return [line.split("\0")[:-1] for line in lines]


def test_prep_sbatch_args_keep_quoted_words_whole(stubs, tmp_path):
    # In double quotes a shell would run $(...); the list keeps it as text.
    words = '--comment="nightly prep" --mail-type=END \'--job-name=a b\' "--x=$(touch hacked)"'
    proc = _run("prep.sbatch", stubs, tmp_path, CONFIG="configs/data/default.yaml", PREP_SBATCH_ARGS=words)
    assert proc.returncode == 0, proc.stderr
    array, merge = _calls(tmp_path, "sbatch")
    for call in (array, merge):
        start = call.index("--comment=nightly prep")
        assert call[start : start + 4] == [
            "--comment=nightly prep",
            "--mail-type=END",
            "--job-name=a b",
            "--x=$(touch hacked)",
        ]
    assert not (REPO / "hacked").exists() and not (tmp_path / "hacked").exists(), "nothing in the list is run"


def test_preflight_args_keep_quoted_words_whole(stubs, tmp_path):
    proc = _run(
        "pretrain.sbatch", stubs, tmp_path, CPU_ONLY="1", PREFLIGHT_ARGS="--min-free-gb '500' --timeout-s \"9 0\""
    )
    assert proc.returncode == 1 and "preflight failed" in proc.stdout, proc.stdout + proc.stderr
    [preflight] = _calls(tmp_path, "srun")
    start = preflight.index("--min-free-gb")
    assert preflight[start : start + 4] == ["--min-free-gb", "500", "--timeout-s", "9 0"]


@pytest.mark.parametrize(
    ("script", "name"), [("prep.sbatch", "PREP_SBATCH_ARGS"), ("pretrain.sbatch", "PREFLIGHT_ARGS")]
)
def test_an_unbalanced_quote_is_one_line_naming_the_variable_and_nothing_is_submitted(script, name, stubs, tmp_path):
    proc = _run(script, stubs, tmp_path, CONFIG="configs/data/default.yaml", **{name: '--comment="nightly'})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {name}='--comment=\"nightly': No closing quotation; quote it as in a shell, e.g. "
        '--comment="nightly prep"'
    ]
    assert not (tmp_path / "sbatch").exists() and not (tmp_path / "srun").exists()

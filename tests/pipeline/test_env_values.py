"""Every environment variable the tools read is checked before any work (issue 64, finding 8): a malformed number
(``PIPE_COLLECTIVE_TIMEOUT_S=nan``, ``LOCAL_RANK=abc``, ``TORCHELASTIC_RESTART_COUNT=-5``) is one line naming the
variable and its value, exit 2, and no ``run_dir``; it used to be a traceback naming no variable, or a watchdog
failing after the run had started.

The variables are found in the code (every ``os.environ`` / ``os.getenv`` / ``env.get`` read, by its AST), so a new
one that `launch_env` does not list fails here before it can escape the check."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.train import dist, launch_env

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("pipeline", "data_prep", "launch", "kernels", "model")
READ_BY_A_GIVEN_NAME = {"pipeline/train/launch_env.py", "launch/slurm/shell_words.py"}
"""The two readers of a variable whose name they are given: the check itself and the sbatch scripts' word splitter."""
ENV_RECEIVERS = {"environ", "env"}
BAD_VALUES = ("abc", "-5", "0", "nan", "inf", "1.5", "")


def _is_env(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ENV_RECEIVERS) or (
        isinstance(node, ast.Attribute) and node.attr in ENV_RECEIVERS
    )


def _name_read(node: ast.AST) -> ast.expr | None:
    """The expression naming the variable that ``node`` reads, if ``node`` reads one."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if node.func.attr == "getenv" or (node.func.attr in ("get", "pop", "setdefault") and _is_env(node.func.value)):
            return node.args[0]
    if isinstance(node, ast.Subscript) and _is_env(node.value):
        return node.slice
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn) and _is_env(node.comparators[0]):
        return node.left
    return None


def _reads(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line, variable name) of every read in ``path``; a name from a module constant is resolved, an f-string's
    fields read ``*``, and a name the code is given is None."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        named = _name_read(node)
        if named is None:
            continue
        if isinstance(named, ast.Constant) and isinstance(named.value, str):
            yield node.lineno, named.value
        elif isinstance(named, ast.Name):
            yield node.lineno, constants.get(named.id)
        elif isinstance(named, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "*" for v in named.values)
        else:
            yield node.lineno, None


def _every_read() -> dict[str, list[str]]:
    """Variable name (None: given) -> the places that read it."""
    found: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            where = str(path.relative_to(REPO))
            for line, name in _reads(path):
                if name is None and where in READ_BY_A_GIVEN_NAME:
                    continue
                found.setdefault(str(name), []).append(f"{where}:{line}")
    return found


def test_every_variable_the_code_reads_is_listed():
    reads = _every_read()
    assert {"RANK", "PIPE_FAULT", "GCA_SHOW_ENV_VALUES", "TRITON_INTERPRET"} <= set(reads), "the scan finds reads"
    listed = {*launch_env.NUMBERS, *launch_env.TEXTS}
    unlisted = {name: places for name, places in reads.items() if name not in listed}
    assert not unlisted, f"add these to launch_env.NUMBERS (checked) or TEXTS (read as text): {unlisted}"


def _bad(name: str) -> list[str]:
    """The values of `BAD_VALUES` that ``name`` does not take (0 is an index's first value)."""
    return [raw for raw in BAD_VALUES if launch_env.NUMBERS[name].parse(raw) is None]


BAD = [(name, raw) for name in launch_env.NUMBERS for raw in _bad(name)]


def test_the_bad_values_cover_each_kind():
    assert launch_env.NUMBERS["RANK"].parse("0") == 0 and ("RANK", "0") not in BAD
    assert ("WORLD_SIZE", "0") in BAD and ("PIPE_STEP_TIMEOUT_S", "0") in BAD and ("MASTER_PORT", "0") in BAD
    assert launch_env.NUMBERS["PIPE_STEP_TIMEOUT_S"].parse("1.5") == 1.5


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in launch_env.NUMBERS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("name", "raw"), BAD)
def test_a_malformed_number_is_refused_by_the_check_before_any_work(clean_env, name, raw):
    """`dist.check_launch` is the first thing the trainer does (the subprocess runs below show it: exit 2, no
    ``run_dir``); here every variable with every bad value, in-process."""
    clean_env.setenv(name, raw)
    with pytest.raises(launch_env.LaunchEnvError) as refused:
        dist.check_launch()
    said = str(refused.value)
    assert said.startswith(f"{name}={raw!r} must be ") and "\n" not in said, said


@pytest.mark.parametrize(
    ("variable", "said"),
    [
        ({"PIPE_COLLECTIVE_TIMEOUT_S": "nan"}, "PIPE_COLLECTIVE_TIMEOUT_S='nan' must be a positive number of seconds"),
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' must be an integer >= 0; torchrun and the deepspeed launcher"),
        ({"RANK": "abc"}, "RANK='abc' must be an integer >= 0; torchrun and the deepspeed launcher sets it"),
        ({"TORCHELASTIC_RESTART_COUNT": "-5"}, "TORCHELASTIC_RESTART_COUNT='-5' must be an integer >= 0; torchrun"),
    ],
    ids=["nan-budget", "local-rank", "rank", "restart-count"],
)
def test_pretrain_says_one_line_and_exits_2(tmp_path, variable, said):
    env = {k: v for k, v in os.environ.items() if k not in launch_env.NUMBERS}
    run = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "launch/pretrain.py"), "--config", "configs/train/tiny.yaml", f"run_dir={run}"]
    proc = subprocess.run(
        cmd, env={**env, **variable, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], proc.stderr[-3000:]
    assert not run.exists()


@pytest.mark.parametrize("tool", ["prep", "eval"])
def test_prep_and_eval_check_the_variable_they_read(tmp_path, tool):
    """They read no launcher variable; ``GCA_SHOW_ENV_VALUES`` is theirs (only 1 shows: "yes" hid without a word)."""
    out = tmp_path / "out"
    args = [f"output={out}"] if tool == "prep" else ["--checkpoint", str(tmp_path), "--task", "ppl", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / f"{tool}.py"), *args],
        env={**os.environ, "GCA_SHOW_ENV_VALUES": "yes", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].endswith(
        "GCA_SHOW_ENV_VALUES='yes' must be 1 (show values taken from the environment) or 0 (hide them, as when unset)"
    )
    assert not out.exists()

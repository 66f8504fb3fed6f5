"""The documented commands run as written after the README's set-up: the README says how to activate .venv, and
after that line a shell whose PATH lacks .venv finds every program the docs' commands start with, and runs the
launch scripts, ``torchrun`` and ``deepspeed``."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = ROOT / ".venv" / "bin"
ACTIVATION = re.compile(r"^(?:source|\.) \S*\.venv/bin/activate\b")
FENCE = re.compile(r"^\s*```(\w*)")
SYSTEM_TOOLS = {"make", "sbatch", "source"}
"""What documented commands start with that is not the venv's: make (the set-up itself), SLURM's sbatch, and the
shell's own ``source``."""


def readme_activation() -> str:
    """The README's activation command: the first line of a bash block that sources .venv/bin/activate."""
    for line in bash_lines(README):
        if ACTIVATION.match(line):
            return line.split("#", 1)[0].strip()
    raise AssertionError("README.md names no `source .venv/bin/activate` line in a bash block")


def bash_lines(page: Path) -> list[str]:
    """The command lines of the page's bash blocks: comments, continuation lines and heredoc bodies left out."""
    commands, language, previous, heredoc = [], None, "", None
    for line in page.read_text().splitlines():
        fence = FENCE.match(line)
        if fence:
            language = fence.group(1) if language is None else None
            previous, heredoc = "", None
            continue
        stripped = line.strip()
        if language != "bash" or not stripped:
            continue
        if heredoc is not None:
            heredoc = None if stripped == heredoc else heredoc
            continue
        if not stripped.startswith("#") and not previous.endswith("\\"):
            commands.append(stripped)
            opened = re.search(r"<<-?'?(\w+)'?", stripped)
            heredoc = opened.group(1) if opened else None
        previous = stripped
    return commands


def program(command: str) -> str:
    """The program a command line starts: its first word after ``NAME=value`` assignments ("" for a line of
    assignments only)."""
    words = re.sub(r"(^|\s)#.*", "", command).split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)
    return words[0] if words else ""


def fresh_shell_env() -> dict[str, str]:
    """A new shell's environment: no venv active, so PATH without .venv/bin."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p).resolve() != VENV_BIN.resolve())
    return env


def in_shell(commands: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", commands], cwd=ROOT, env=fresh_shell_env(), capture_output=True, text=True, timeout=300
    )


def documented_programs() -> set[str]:
    return {program(line) for page in PAGES for line in bash_lines(page)} - {""}


def test_the_readme_activates_before_anything_else_is_documented():
    """The activation line is in the README's Quick start, before its first python/deepspeed/torchrun command."""
    lines = bash_lines(README)
    first = next(i for i, line in enumerate(lines) if program(line) not in SYSTEM_TOOLS)
    assert any(ACTIVATION.match(line) for line in lines[:first]), lines[: first + 1]


def test_without_activation_the_documented_command_fails():
    """The reason for the line: the shell the test starts really lacks the venv."""
    done = in_shell("python3 launch/prep.py --help")
    assert done.returncode != 0 and "data_prep" in done.stderr, done.stderr[-2000:]


def test_after_the_readmes_activation_every_documented_program_runs():
    programs = documented_programs()
    assert {"python", "deepspeed", "torchrun"} <= programs
    venv_programs = sorted(programs - SYSTEM_TOOLS)
    checks = " && ".join(
        [
            readme_activation(),
            *(f"command -v {name}" for name in venv_programs),
            "python launch/prep.py --help",
            "python launch/pretrain.py --help",
            "torchrun --help",
            "deepspeed --help",
        ]
    )
    done = in_shell(checks)
    assert done.returncode == 0, done.stderr[-3000:]
    found = done.stdout.splitlines()[: len(venv_programs)]
    assert [Path(path).parent.resolve() for path in found] == [VENV_BIN.resolve()] * len(venv_programs), found
    for usage in ("usage: prep.py", "usage: pretrain.py", "usage: torchrun", "usage: deepspeed"):
        assert usage in done.stdout, done.stdout[-3000:]


def test_the_command_parser_reads_commands_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nsource .venv/bin/activate   # once\n# a comment\nX=1 python a.py \\\n    --flag\n"
        "python - <<'EOF'\nimport os\nEOF\ntorchrun b.py\n```\n```\nnot bash\n```\n"
    )
    lines = bash_lines(page)
    assert lines == ["source .venv/bin/activate   # once", "X=1 python a.py \\", "python - <<'EOF'", "torchrun b.py"]
    assert [program(line) for line in lines] == ["source", "python", "python", "torchrun"]
    assert program("DATA=data/x   # a name") == ""

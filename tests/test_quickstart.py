"""docs/quickstart.md runs as written: its marked blocks, from a shell whose PATH lacks .venv, on text files the test
writes, with the test's own folders for the page's three names and the two substitutions the page itself lists.

The full chain (prep -> 2 training steps -> ppl and passkey -> export -> transformers) is in the slow tier
(``make test-quickstart``); the two-rank DeepSpeed block in the dist tier; what ties the test to the page is checked
in the default tier."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs/quickstart.md"
VENV_BIN = ROOT / ".venv" / "bin"
MARK = re.compile(r"^<!-- quickstart: ([a-z]+) -->$")
NAMES = ("TEXTS", "DATA", "RUN")
"""The names the page's commands use for the user's folders; the test gives each a folder of its own."""
SUBSTITUTIONS = {
    "train.max_steps=600": "train.max_steps=2 schedule.warmup_steps=1",  # 2 steps, not 15 minutes
    "step_00000600": "step_00000002",  # the checkpoint of the last of those steps
}
"""The only changes to the page's commands (docs/quickstart.md, "How this page is tested", lists the same)."""
PROMPT = "It was a dark and stormy night"


def marked_blocks(text: str) -> dict[str, list[str]]:
    """Marker name -> the bash blocks that a ``<!-- quickstart: name -->`` line right above them marks."""
    blocks: dict[str, list[str]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = MARK.match(line)
        if not match:
            continue
        assert lines[i + 1] == "```bash", f"{PAGE.name}:{i + 1}: a quickstart marker must sit right above a bash fence"
        end = lines.index("```", i + 2)
        blocks.setdefault(match.group(1), []).append("\n".join(lines[i + 2 : end]) + "\n")
    return blocks


def page_blocks() -> dict[str, list[str]]:
    return marked_blocks(PAGE.read_text())


def substituted(block: str) -> str:
    for old, new in SUBSTITUTIONS.items():
        block = block.replace(old, new)
    return block


def fresh_shell_env() -> dict[str, str]:
    """This environment as a new login shell would have it: no venv active, nothing of this test run inherited."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "OMP_NUM_THREADS"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p).resolve() != VENV_BIN.resolve())
    return env


def names(tmp_path: Path) -> dict[str, Path]:
    return {name: tmp_path / name.lower() for name in NAMES}


def script(folders: dict[str, Path], *blocks: str) -> str:
    """One bash script: stop at the first failing command, the names set, then the blocks."""
    assigned = "".join(f"{name}={shlex.quote(str(path))}\n" for name, path in folders.items())
    return "set -euo pipefail\n" + assigned + "".join(blocks)


def write_texts(folder: Path, books: int = 6) -> None:
    """A few "books" of made-up words (2.3 MB, 550K tokens): enough distinct text for the page's 8000-piece tokenizer,
    and a validation split (1%) longer than the page's longest ppl length, as a corpus of a few real books has."""
    rng = random.Random(0)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choice(letters[: rng.randint(8, 26)]) for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    folder.mkdir(parents=True)
    for book in range(books):
        lines = (" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))).capitalize() + "." for _ in range(6000))
        (folder / f"book{book}.txt").write_text("\n".join(lines) + "\n")


def run_bash(text: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", text], cwd=ROOT, env=fresh_shell_env(), capture_output=True, text=True, timeout=timeout
    )


def test_the_test_runs_what_the_page_says():
    """The page has the marked blocks, names exactly the folders the test sets, and holds every substituted text;
    its setup block activates .venv the way the README says."""
    blocks = page_blocks()
    assert {"setup", "names", "run", "dist"} <= set(blocks), sorted(blocks)
    assigned = re.findall(r"(?m)^([A-Z_]+)=", "".join(blocks["names"]))
    assert tuple(assigned) == NAMES
    commands = "".join(blocks["run"] + blocks["dist"])
    for name in NAMES:
        assert f"${name}" in commands
    for old in SUBSTITUTIONS:
        assert old in "".join(blocks["run"]), f"substitution {old!r} matches nothing on the page"
    from test_documented_commands import readme_activation

    assert readme_activation() in "".join(blocks["setup"])


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path):
    import sentencepiece as spm
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folders = names(tmp_path)
    write_texts(folders["TEXTS"])
    blocks = page_blocks()
    done = run_bash(script(folders, *blocks["setup"], *map(substituted, blocks["run"])), timeout=1500)
    assert done.returncode == 0, done.stderr[-5000:]

    data, run = folders["DATA"], folders["RUN"]
    pieces = spm.SentencePieceProcessor(model_file=str(data / "tokenizer.model")).get_piece_size()
    assert pieces == 8000
    exported = run / "export_600"
    assert json.loads((exported / "config.json").read_text())["model"]["vocab_size"] == pieces
    # launch/export.py's export of the last checkpoint holds the weights the trainer exported at that step.
    ours, trainers = load_file(str(exported / "model.safetensors")), load_file(str(run / "export/model.safetensors"))
    assert ours.keys() == trainers.keys() and all((ours[k] == trainers[k]).all() for k in ours)
    for task in ("ppl", "passkey"):  # the page's lengths=[1024,4096], each measured
        rows = json.loads((run / "eval" / f"{task}.json").read_text())["results"]
        assert {row.get("length") for row in rows} >= {1024, 4096}, rows
        assert f"{task}.json" in (run / "eval/report.md").read_text()
    # What the page's transformers step printed is the export's greedy continuation, generated again here.
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=40, do_sample=False)[0]
    assert len(generated) > len(ids[0])
    assert done.stdout.endswith(tokenizer.decode(generated) + "\n"), done.stdout[-2000:]


@pytest.mark.dist
def test_the_two_rank_deepspeed_block_runs_as_written(tmp_path):
    from data_prep.cli import main as prep

    folders = names(tmp_path)
    write_texts(folders["TEXTS"])
    assert prep([f"input={folders['TEXTS']}", f"output={folders['DATA']}", "tokenizer.vocab_size=8000"]) == 0
    blocks = page_blocks()
    done = run_bash(script(folders, *blocks["setup"], *map(substituted, blocks["dist"])), timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    run = Path(f"{folders['RUN']}-ds")
    assert (run / "checkpoints/step_00000002/COMMITTED").exists()
    assert json.loads((run / "export/config.json").read_text())["model"]["vocab_size"] == 8000  # the tokenizer's

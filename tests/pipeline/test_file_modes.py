"""Every file the tools write gets the mode the umask gives (issue 64, finding 4): ``0o666 & ~umask`` for files,
``0o777 & ~umask`` for folders, so that under umask 022 a teammate on a shared cluster reads the weights as well as
the config. The exported weights were 0600 whatever the umask (safetensors writes its own owner-only temporary
file and renames it over the name `data_prep.safe_write.replacing` hands it).

One prep, an FSDP training run with a checkpoint (holding an eval export) and a validation pass, ``launch/export.py``
of a checkpoint and an eval ``--out``, each as its own process under the umask; then every entry of the trees they
wrote is checked, found by walking them (files third-party code wrote inside, such as torch.distributed.checkpoint's,
included)."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import train_overrides

REPO = Path(__file__).resolve().parents[2]
WORDS = "the grass is green the sky is blue here we go again a river runs past old stones under bright light".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 text files of a few hundred words: enough for a 300-piece tokenizer and a train and a val split."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(80):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 300)))
        (root / f"doc{i:03d}.txt").write_text(text + "\n", encoding="utf-8")
    return root


def _run(args: list[str], umask: int) -> None:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        umask=umask,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (args[0], proc.stderr[-4000:])


def _wrong_modes(root: Path, umask: int) -> tuple[list[str], int]:
    """Each entry under ``root`` (itself included) whose mode is not the umask's, and how many entries there are."""
    wrong, count = [], 0
    for folder, _, files in os.walk(root):  # each folder once, as ``folder``, with the files in it
        for path in [Path(folder), *(Path(folder) / name for name in files)]:
            st = os.lstat(path)
            want = (0o777 if stat.S_ISDIR(st.st_mode) else 0o666) & ~umask
            count += 1
            if stat.S_IMODE(st.st_mode) != want:
                wrong.append(f"{path}: {stat.S_IMODE(st.st_mode):o}, not {want:o}")
    return wrong, count


@pytest.mark.parametrize("umask", [0o022, pytest.param(0o077, marks=pytest.mark.slow)], ids=["umask022", "umask077"])
def test_every_file_prep_training_export_and_eval_write_gets_the_umask_mode(umask, corpus, tmp_path):
    data, run, exported, evaluated = (tmp_path / name for name in ("data", "run", "exported", "eval"))
    prep = [f"input={corpus}", f"output={data}", "tokenizer.vocab_size=300", "val_fraction=0.2", "progress=false"]
    _run(["launch/prep.py", *prep, "num_proc=1"], umask)
    steps = {  # FSDP in one process: its checkpoints hold torch.distributed.checkpoint's own files
        "parallel.engine": "fsdp",
        "model.vocab_size": 300,
        "train.max_steps": 2,
        "schedule.warmup_steps": 1,
        "checkpoint.every": 2,
        "train.eval_every": 2,
    }
    _run(["launch/pretrain.py", "--config", "configs/train/debug.yaml", *train_overrides(run, data, steps)], umask)
    checkpoint = run / "checkpoints" / "step_00000002"
    _run(["launch/export.py", "--checkpoint", str(checkpoint), "--out", str(exported)], umask)
    passkey = ["--task", "passkey", "lengths=[300]", "depths=[0.5]", "samples=1", "progress=false"]
    _run(["launch/eval.py", "--checkpoint", str(run / "export"), "--out", str(evaluated), *passkey], umask)

    for weights in (run / "export", checkpoint / "export", exported):  # the files the finding is about
        assert (weights / "model.safetensors").is_file()
    assert (evaluated / "passkey.json").is_file() and (checkpoint / "dcp" / ".metadata").is_file()
    wrong, count = [], 0
    for root in (data, run, exported, evaluated):
        found = _wrong_modes(root, umask)
        wrong += found[0]
        count += found[1]
    assert count > 100 and not wrong, wrong

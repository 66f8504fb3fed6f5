"""``model.vocab_size`` left out of a training config is the size of the dataset's tokenizer (as ``init_from`` gives
a run its checkpoint's shapes); a value the config sets is kept and still checked against the tokenizer."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from helpers import TINY_TRAIN_OVERRIDES
from safetensors import safe_open

from data_prep import format as fmt
from data_prep.cli import main as prep
from pipeline.train.config import load_config
from pipeline.train.trainer import main as train

REPO = Path(__file__).resolve().parents[2]
ASKED = 320
"""``tokenizer.vocab_size`` of the prep run (SentencePiece's smallest lossless size is a little under 300)."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three text files through data prep with its own tokenizer, as a user's corpus would go."""
    root = tmp_path_factory.mktemp("vocab")
    texts = root / "texts"
    texts.mkdir()
    rng = random.Random(0)
    words = "the river runs past old stone walls where green moss grows under a grey sky".split()
    for i in range(3):
        lines = (" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400))
        (texts / f"book{i}.txt").write_text("\n".join(lines) + "\n")
    out = root / "data"
    overrides = [f"input={texts}", f"output={out}", f"tokenizer.vocab_size={ASKED}", "val_fraction=0", "progress=false"]
    assert prep(overrides) == 0
    return out


def tokenizer_pieces(data: Path) -> int:
    """The tokenizer file's own count, read with SentencePiece (not through the manifest the trainer reads)."""
    return spm.SentencePieceProcessor(model_file=str(data / fmt.TOKENIZER_FILENAME)).get_piece_size()


def overrides(run: Path, data: Path, **extra: object) -> list[str]:
    """The tests' tiny model without its ``model.vocab_size``, 2 steps."""
    settings = {k: v for k, v in TINY_TRAIN_OVERRIDES.items() if k != "model.vocab_size"}
    settings |= {"run_dir": run, "data.path": data, "train.max_steps": 2, "schedule.warmup_steps": 1, **extra}
    return [f"{k}={v}" for k, v in settings.items()]


def test_a_run_without_vocab_size_has_the_tokenizers_rows(prepared, tmp_path):
    pieces = tokenizer_pieces(prepared)
    assert pieces != TINY_TRAIN_OVERRIDES["model.vocab_size"] and pieces != 4096  # neither default could pass
    run = tmp_path / "run"
    assert train(None, overrides(run, prepared)) == 0
    for export in (run / "export", run / "checkpoints/step_00000002/export"):
        assert json.loads((export / "config.json").read_text())["model"]["vocab_size"] == pieces
        with safe_open(str(export / "model.safetensors"), "pt") as weights:
            rows = {name: weights.get_slice(name).get_shape()[0] for name in weights.keys() if "embed" in name}
        assert rows and set(rows.values()) == {pieces}, rows


def test_a_value_the_config_sets_is_kept(prepared, tmp_path):
    pieces = tokenizer_pieces(prepared)
    larger = load_config(None, overrides(tmp_path / "run", prepared, **{"model.vocab_size": pieces + 64}))
    assert larger.model.vocab_size == pieces + 64
    # A dataset without a manifest (hand-written MDS, or not prepared yet) keeps the schema default.
    assert load_config(None, overrides(tmp_path / "run", tmp_path / "nothing")).model.vocab_size == 4096


def test_a_value_too_small_for_the_tokenizer_is_one_line_and_exit_2(prepared, tmp_path):
    pieces = tokenizer_pieces(prepared)
    run = tmp_path / "run"
    settings = [f"data.path={prepared}", f"run_dir={run}", f"model.vocab_size={pieces - 1}"]
    cmd = [sys.executable, "launch/pretrain.py", "--config", "configs/train/tiny.yaml", *settings]
    done = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert f"has {pieces} pieces but model.vocab_size={pieces - 1}" in lines[0]
    assert not (run / "checkpoints").exists()

"""Helpers of the failure-test catalogue (T1-T23, docs/reliability.md); fixtures in conftest.py.

A tiny prepared dataset written the way data prep writes it (MDS shards with sha256 + xxh64, manifest.json and
the ``_COMPLETE`` marker), overrides for a ~0.05M-parameter model, launchers that run the trainer in fresh
processes under a hard timeout (the whole process group is killed on expiry, and a timeout fails the test), and
cleanup of the shared memory that DeepSpeed and killed streaming readers leave in /dev/shm.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import markov_pieces, train_overrides, train_test_tokenizer, write_mds_split

from data_prep import format as fmt

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
EOS = 1
CONFIG = str(REPO / "configs/train/debug.yaml")


# -- data ------------------------------------------------------------------------------------------------------


def write_split(root: Path, split: str, n_docs: int, seed: int, size_limit: int = 4096) -> fmt.SplitStats:
    """``n_docs`` documents of the shared Markov chain (learnable in a few steps), 40-200 tokens, 1-3 pieces each."""
    rows = list(markov_pieces(n_docs, seed, vocab=VOCAB))
    write_mds_split(root / split, rows, size_limit=size_limit, hashes=("sha256", "xxh64"))
    index = hashlib.sha256((root / split / "index.json").read_bytes()).hexdigest()
    tokens = sum(len(part) for _, _, part in rows)
    return fmt.SplitStats(documents=n_docs, pieces=len(rows), tokens=tokens, index_sha256=index)


def tokenizer_bytes() -> bytes:
    words = "the grass is green the sky is blue here we go again".split()
    rng = np.random.default_rng(0)
    return train_test_tokenizer((" ".join(rng.choice(words, 12)) for _ in range(300)), VOCAB, eos_id=EOS)


def write_dataset(root: Path, n_train: int = 200, n_val: int = 20) -> Path:
    """A complete prepared dataset: train/, val/, tokenizer.model, manifest.json, _COMPLETE (as data prep writes)."""
    root.mkdir(parents=True, exist_ok=True)
    splits = {"train": write_split(root, "train", n_train, seed=1), "val": write_split(root, "val", n_val, seed=2)}
    model = tokenizer_bytes()
    (root / fmt.TOKENIZER_FILENAME).write_bytes(model)
    info = fmt.TokenizerInfo(
        sha256=hashlib.sha256(model).hexdigest(),
        vocab_size=VOCAB,
        model_type="bpe",
        trained=True,
        unk_id=0,
        bos_id=-1,
        eos_id=EOS,
        pad_id=-1,
    )
    manifest = fmt.Manifest(
        format_version=fmt.FORMAT_VERSION,
        token_dtype="uint16",
        tokenizer=info,
        splits=splits,
        skipped={},
        inputs=[],
        config={"source": "tests/reliability"},
    )
    write_manifest(root, manifest)
    return root


def write_manifest(root: Path, manifest: fmt.Manifest) -> None:
    """``manifest.json`` and the ``_COMPLETE`` marker that seals it, as data prep writes them last."""
    data = manifest.to_json().encode()
    (root / fmt.MANIFEST_FILENAME).write_bytes(data)
    (root / fmt.COMPLETE_MARKER).write_text(hashlib.sha256(data).hexdigest() + "\n")


def rewrite_split(root: Path, split: str, n_docs: int, seed: int) -> None:
    """Replace ``split`` with ``n_docs`` other documents and record it in the manifest: what preparing the data again
    with more documents gives (a consistent dataset, other data)."""
    shutil.rmtree(root / split)
    manifest = fmt.read_manifest(root)
    write_manifest(
        root, dataclasses.replace(manifest, splits={**manifest.splits, split: write_split(root, split, n_docs, seed)})
    )


# -- runs ------------------------------------------------------------------------------------------------------


HARNESS_SETTINGS = {
    "train.eval_every": 0,
    "checkpoint.every": 4,
    "checkpoint.keep_last": 10,
    "checkpoint.export": False,
}
"""What the catalogue's runs pin on top of the shared tiny model, for speed (no eval, no export)."""


def overrides(run_dir: Path, data_dir: Path, **extra: object) -> list[str]:
    """A ~0.05M-parameter GCA model on the test data (naive backend, a few ms per step on CPU)."""
    return train_overrides(run_dir, data_dir, HARNESS_SETTINGS, extra)


@dataclass
class Result:
    returncode: int
    output: str
    wall_s: float


def run_process(cmd: list[str], timeout: float, fault: str | None = None, env: dict[str, str] | None = None) -> Result:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail the test (never skip)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_SILENT": "true"}
    full_env.pop("PIPE_FAULT", None)
    full_env.update(env or {})
    if fault:
        full_env["PIPE_FAULT"] = fault
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=REPO, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s (process group killed): {' '.join(cmd[-6:])}\n{out[-4000:]}")
    return Result(proc.returncode, out, time.monotonic() - t0)


def train_ranks(
    nproc: int, args: list[str], fault: str | None = None, timeout: float = 180, env: dict[str, str] | None = None
) -> Result:
    """``torchrun --standalone --nproc_per_node nproc launch/pretrain.py`` (gloo on CPU); no restarts. Standalone
    rendezvous binds its own free port, so concurrent test runs on the machine cannot race for one."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        "0",
        str(REPO / "launch/pretrain.py"),
        "--config",
        CONFIG,
        *args,
    ]
    return run_process(cmd, timeout, fault, env)


def train_process(
    args: list[str], fault: str | None = None, timeout: float = 120, env: dict[str, str] | None = None
) -> Result:
    """One ``python launch/pretrain.py`` process."""
    cmd = [sys.executable, str(REPO / "launch/pretrain.py"), "--config", CONFIG, *args]
    return run_process(cmd, timeout, fault, env)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Per-step metrics; a step logged twice (re-run after a crash) keeps its last record."""
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and "loss" in rec:
            records[rec["step"]] = rec
    return records


def committed(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if (p / "COMMITTED").is_file()) if root.is_dir() else []


def assert_same_steps(a: Path, b: Path, steps: range, keys: tuple[str, ...] = ("loss", "grad_norm", "lr")) -> None:
    """Bitwise equal per-step scalars (``float.hex``); names the first differing step and key."""
    ma, mb = read_metrics(a), read_metrics(b)
    for step in steps:
        for key in keys:
            assert ma[step][key].hex() == mb[step][key].hex(), f"step {step} {key}: {ma[step][key]} vs {mb[step][key]}"


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Model, optimizer, per-rank RNG and data-loader state of two checkpoints are bitwise equal (torch engine)."""
    sa = torch.load(a / "state.pt", weights_only=True)
    sb = torch.load(b / "state.pt", weights_only=True)
    assert sa["model"].keys() == sb["model"].keys()
    for name in sa["model"]:
        assert torch.equal(sa["model"][name], sb["model"][name]), f"model tensor {name} differs"
    assert sa["optim"]["param_groups"] == sb["optim"]["param_groups"]
    for pid, moments in sa["optim"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, sb["optim"]["state"][pid][key]), f"optimizer state {pid}.{key} differs"
    rng_a, rng_b = sorted(a.glob("rng_rank*.pt")), sorted(b.glob("rng_rank*.pt"))
    assert [p.name for p in rng_a] == [p.name for p in rng_b]
    for pa, pb in zip(rng_a, rng_b):
        assert torch.equal(torch.load(pa, weights_only=True)["cpu"], torch.load(pb, weights_only=True)["cpu"]), pa.name
    ta, tb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    for key in ("step", "tokens_seen", "data", "data_fingerprint", "parallel", "world_size"):
        assert ta[key] == tb[key], f"trainer state {key}: {ta[key]} vs {tb[key]}"


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte (the middle one by default)."""
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if offset is None else offset
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


# -- shared memory ---------------------------------------------------------------------------------------------

STREAMING_SHM = re.compile(r"\d{6}_.+")


def mapped_shm() -> set[str]:
    """/dev/shm files some live process has mapped (so they belong to a running job, perhaps not ours)."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return mapped

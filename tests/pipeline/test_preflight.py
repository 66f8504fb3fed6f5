"""Preflight checks (``pipeline/train/preflight.py``): each passes on a good setup, else gives one clear line."""

import logging
import mmap
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import prepared_copy

from data_prep import format as fmt
from pipeline.train import preflight
from pipeline.train.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_data_check(tmp_path, tiny_data):
    root = prepared_copy(tmp_path, tiny_data)
    assert preflight.check_data(str(root), "train", 64) == []
    assert preflight.check_data("s3://bucket/data", "train", 64) == []  # remote: the trainer checks while reading
    [line] = preflight.check_data(str(root), "train", 32)
    assert line == (f"data: the tokenizer of {root} has 64 pieces but model.vocab_size=32; set model.vocab_size >= 64")
    [line] = preflight.check_data(str(root), "nosplit", 64)
    assert line.startswith(f"data: cannot read {root}/nosplit/index.json: No such file")
    assert preflight.check_data(str(root), "train", 64, val_split="val") == []
    index = root / "train" / "index.json"
    recorded = index.read_bytes()
    index.write_bytes(recorded.replace(b'"samples":', b'"samples": ', 1))  # the same index, other bytes
    [line] = preflight.check_data(str(root), "train", 64)
    assert line.startswith(f"data: {index} is not the one data prep recorded in manifest.json (sha256 ")
    index.write_bytes(recorded)
    for shard in (root / "val").glob("shard.00001.*"):
        shard.unlink()
    [line] = preflight.check_data(str(root), "train", 64, val_split="val")
    assert line == (f"data: {root}/val: 1 shard(s) listed in index.json are missing (first: shard 1); re-run data prep")
    (root / fmt.MANIFEST_FILENAME).write_text("{}")
    [line] = preflight.check_data(str(root), "train", 64)
    assert line.startswith(f"data: {root}/manifest.json does not match {root}/_COMPLETE")
    [line] = preflight.check_data(str(tiny_data), "train", 64)
    assert line.startswith(f"data: {tiny_data} is not a completed prepared dataset (no _COMPLETE or manifest.json)")


def test_writable_and_free_disk(tmp_path):
    assert preflight.check_writable(tmp_path / "new" / "run") == []
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
    (tmp_path / "file").write_text("")
    [line] = preflight.check_writable(tmp_path / "file" / "run")
    assert line == f"checkpoint dir: cannot write to {tmp_path / 'file' / 'run'}: Not a directory"
    assert preflight.check_free_disk(tmp_path / "not" / "yet", 1) == []
    [line] = preflight.check_free_disk(tmp_path / "not" / "yet", 2**60)
    assert line.startswith("free disk: ") and f"GiB free at {tmp_path}, need 1073741824.0 GiB" in line


def test_checkpoint_estimate_counts_parameters(tmp_path, tiny_data, overrides):
    from model import GCAForCausalLM

    cfg = load_config(None, overrides(tmp_path, tiny_data))
    n_params = sum(p.numel() for p in GCAForCausalLM(cfg.model).parameters())
    assert preflight.checkpoint_bytes(cfg) == 16 * n_params
    cfg = load_config(None, overrides(tmp_path, tiny_data, **{"checkpoint.export": False}))
    assert preflight.checkpoint_bytes(cfg) == 12 * n_params


def test_stale_shared_memory_is_removed_unless_in_use(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = [shm / "000012_locals", shm / "000000_barrier", shm / "deepspeed_allreduce_buffer_0_127.0.0.1_29500_1"]
    mapped, held = shm / "000013_shard_states", shm / "000014_cache_usage"
    others = [shm / "12345_short_prefix", shm / "wandb-0001", shm / "000015_dir"]
    for path in [*stale, mapped, held, *others[:2]]:
        path.write_bytes(b"\0" * 4096)
    others[2].mkdir()
    with open(mapped, "r+b") as f:
        mem = mmap.mmap(f.fileno(), 4096)  # mapped, file descriptor closed: like a live streaming loader
    fd = os.open(held, os.O_RDONLY)
    try:
        removed = preflight.clean_stale_shm(shm)
        assert sorted(removed) == sorted(stale)
        assert sorted(p.name for p in shm.iterdir()) == sorted(p.name for p in [mapped, held, *others])
    finally:
        mem.close()
        os.close(fd)
    assert sorted(preflight.clean_stale_shm(shm)) == [mapped, held]


def test_version_mismatch_names_rank_host_and_package():
    ref = {"torch": "2.13.0", "deepspeed": "0.19.8", "git": "abc"}
    reports = [
        preflight.Report("n0", 0, 0, ref),
        preflight.Report("n0", 1, 1, dict(ref)),
        preflight.Report("n1", 2, 0, {**ref, "torch": "2.12.0", "git": "abd"}),
    ]
    assert preflight.compare_versions(reports) == [
        "preflight: n1 rank 2: versions: git abd (rank 0 on n0: abc), torch 2.12.0 (rank 0 on n0: 2.13.0); "
        "install the same environment on every node"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answers")
def test_accelerators_on_cpu():
    assert preflight.check_accelerators(0, 0) == []
    assert preflight.check_accelerators(None, 0) == []
    [line] = preflight.check_accelerators(8, 3)
    assert line.startswith("accelerators: expected 8 GPUs per node but torch") and "--gpus-per-node 0" in line


def test_main_passes_then_reports_one_line_per_problem(tmp_path, tiny_data, overrides, caplog):
    data = prepared_copy(tmp_path, tiny_data)
    caplog.set_level(logging.INFO)
    assert preflight.main(None, overrides(tmp_path / "run", data), 0, 0.001, 60) == 0
    assert "preflight OK: 1 rank(s)" in caplog.text
    caplog.clear()
    (tmp_path / "file").write_text("")
    bad = overrides(tmp_path / "file" / "run", tmp_path / "missing", **{"model.vocab_size": 32})
    assert preflight.main(None, bad, 0, 0.001, 60) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, errors
    assert errors[0].startswith(f"preflight: {os.uname().nodename} rank 0: data: {tmp_path / 'missing'} is not a ")
    assert errors[1].startswith("preflight: ") and "checkpoint dir: cannot write to" in errors[1]
    assert errors[2] == "preflight FAILED: 2 problem(s); fix them before launching"
    assert preflight.main(None, [*bad, "nokey=1"], 0, 0.001, 60) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_missing_rank_ends_in_one_line_not_a_hang(tmp_path, tiny_data, overrides):
    """Rank 0 of a 2-rank job whose rank 1 never comes: the watchdog reports and exits 1."""
    data = prepared_copy(tmp_path, tiny_data)
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        str(REPO / "launch/preflight.py"),
        "--timeout-s",
        "4",
        "--min-free-gb",
        "0",
        "--gpus-per-node",
        "0",
        "--config",
        str(REPO / "configs/train/debug.yaml"),
        *overrides(tmp_path / "run", data),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "backend: no answer from the other ranks within 4 s" in errors[0], proc.stderr

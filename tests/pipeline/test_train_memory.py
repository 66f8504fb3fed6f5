"""The trainer refuses, before any work, a run whose host memory estimate exceeds what the host can give.

Nothing here allocates what it estimates: the host's memory reading is replaced, and the trainer itself is a spy
that fails the test if a run starts after the check should have refused it (before the check existed, the run
below would have started filling an 8.6 GB shuffle window).
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TINY_TRAIN_OVERRIDES

from model import GCAConfig, GCAForCausalLM
from pipeline.data import host_memory
from pipeline.train import trainer

LONG = {"train.seq_len": 16777216, "train.micro_batch": 1, "train.global_batch": 1, "data.shuffle_window": 64}
"""The issue's probe: one 16M-token sequence per step, the reader's default window of 64 sequences."""


class Started(Exception):
    """The trainer was built: the memory check let the run through."""


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(*args, **kwargs):
        raise Started

    monkeypatch.setattr(trainer, "Trainer", build)


def reference_bytes(model_keys: dict) -> int:
    """The documented lower bound, written out: the shuffle window and one step's micro-batches as int64 ids,
    and (training on CPU) 16 bytes of model state per parameter, on one rank."""
    seq_len = LONG["train.seq_len"]
    ids = 8 * seq_len * (LONG["data.shuffle_window"] + LONG["train.global_batch"])
    params = sum(p.numel() for p in GCAForCausalLM(GCAConfig(**model_keys)).parameters())
    return ids + (0 if torch.cuda.is_available() else 16 * params)


def test_a_run_the_host_cannot_hold_is_one_line_before_any_work(
    tmp_path, tiny_data, overrides, monkeypatch, caplog, started
):
    model_keys = {k.removeprefix("model."): v for k, v in TINY_TRAIN_OVERRIDES.items() if k.startswith("model.")}
    model_keys["groups"] = [1]
    need = reference_bytes(model_keys)
    assert need > 8.5e9  # the window alone: 64 x 16M x 8 bytes
    run = tmp_path / "run"
    args = overrides(run, tiny_data, **LONG)
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(4 << 30, "a 4 GiB cgroup"))
    with caplog.at_level(logging.ERROR):
        assert trainer.main(None, args) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    for fragment in ("train.seq_len=16777216", "data.shuffle_window=64", "4.0 GiB (a 4 GiB cgroup)"):
        assert fragment in line, line
    assert not run.exists()
    # The estimate is what the docs say: a host with exactly that much passes the check, one byte less does not.
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(need - 1, "test"))
    assert trainer.main(None, args) == 2
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(need, "test"))
    with pytest.raises(Started):
        trainer.main(None, args)


def test_under_ulimit_v_the_real_reading_refuses_the_run(tmp_path, tiny_data, overrides):
    """No reading replaced: the trainer in its own process under a 4 GiB address-space limit (``ulimit -v``; the
    issue's probe ended in a numpy MemoryError traceback there) reads the limit itself and refuses in one line."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    run, config = tmp_path / "run", tmp_path / "empty.yaml"
    config.write_text("")  # every key is an override
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.train", "--config", str(config), *overrides(run, tiny_data, **LONG)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=limit,
        cwd=Path(__file__).resolve().parents[2],
    )
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "train.seq_len=16777216" in errors[0] and "(ulimit -v)" in errors[0]
    assert not run.exists()

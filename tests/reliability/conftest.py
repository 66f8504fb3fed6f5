"""Fixtures of the failure-test catalogue (docs/reliability.md T1-T23); the helpers are in reliability_harness.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from reliability_harness import STREAMING_SHM, mapped_shm, write_dataset


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared dataset (never modified by a test; tests that damage data use ``data_copy``)."""
    return write_dataset(tmp_path_factory.mktemp("reliability") / "data")


@pytest.fixture
def data_copy(data: Path, tmp_path: Path) -> Path:
    """A private copy of the dataset, free to corrupt."""
    return Path(shutil.copytree(data, tmp_path / "data_copy"))


@pytest.fixture(autouse=True)
def _clean_shm():
    """After each test, remove the /dev/shm files it left: DeepSpeed's CPU allreduce buffers and the segments of
    killed streaming readers (whose own cleaner misses prefixes other than 0). Files that existed before the test,
    or that a live process still maps, are left alone."""
    before = set(os.listdir("/dev/shm"))
    yield
    new = set(os.listdir("/dev/shm")) - before
    if not new:
        return
    mapped = mapped_shm()
    for name in new:
        path = f"/dev/shm/{name}"
        if (name.startswith("deepspeed_allreduce_buffer_") or STREAMING_SHM.fullmatch(name)) and path not in mapped:
            try:
                os.remove(path)
            except OSError:
                pass


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch):
    """One intra-op thread (2 shared cores; tiny ops slow down 20x when oversubscribed), no fault planned, and no
    launcher variables: in-process FSDP runs create a one-rank group that writes MASTER_ADDR/PORT into the
    environment, which must not leak into the next test."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("PIPE_FAULT", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

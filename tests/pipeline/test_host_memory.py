"""``pipeline.data.host_memory`` reads the limits a process runs under: cgroup v1 (hybrid hosts such as this one)
and v2 trees are built in a temporary directory in the kernel's file formats, ``/proc/meminfo`` is replaced."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline.data import host_memory
from pipeline.train import trainer

GIB = 1 << 30
V1_UNLIMITED = "9223372036854771712"
"""What cgroup v1 writes for no limit."""


def fake_host(monkeypatch: pytest.MonkeyPatch, root: Path, proc_cgroup: str, files: dict[str, str], swap_free: int):
    """A host with 20 GiB available, ``swap_free`` of swap, this process in ``proc_cgroup`` and ``files`` (path
    under the cgroup mount -> content)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (root / "self_cgroup").write_text(proc_cgroup)
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_memory, "PROC_CGROUP", root / "self_cgroup")
    monkeypatch.setattr(host_memory, "_meminfo", lambda: {"MemAvailable": 20 * GIB, "SwapFree": swap_free})


def test_cgroup_v1_limits_and_their_ancestors(tmp_path, monkeypatch):
    proc = "4:memory:/jobs/probe\n0::/\n"
    files = {"memory/jobs/probe/memory.limit_in_bytes": str(4 * GIB), "memory/jobs/memory.limit_in_bytes": V1_UNLIMITED}
    fake_host(monkeypatch, tmp_path, proc, files, swap_free=0)
    got = host_memory.available_memory()
    assert got is not None and got.bytes == 4 * GIB and "jobs/probe/memory.limit_in_bytes" in got.limit
    # (The tree grows over these calls.) Free swap is on top, unless memory.memsw.limit_in_bytes caps memory and
    # swap together; a parent's lower limit wins.
    fake_host(monkeypatch, tmp_path, proc, {}, swap_free=GIB)
    assert host_memory.available_memory().bytes == 5 * GIB
    fake_host(monkeypatch, tmp_path, proc, {"memory/jobs/probe/memory.memsw.limit_in_bytes": str(4 * GIB + 1)}, GIB)
    assert host_memory.available_memory().bytes == 4 * GIB + 1
    fake_host(monkeypatch, tmp_path, proc, {"memory/jobs/memory.limit_in_bytes": str(3 * GIB)}, swap_free=0)
    assert host_memory.available_memory().bytes == 3 * GIB


def test_cgroup_v2_limit_with_its_swap_and_no_limit(tmp_path, monkeypatch):
    files = {"job/memory.max": str(3 * GIB), "job/memory.swap.max": str(GIB)}
    fake_host(monkeypatch, tmp_path, "0::/job\n", files, swap_free=2 * GIB)
    got = host_memory.available_memory()
    assert got is not None and got.bytes == 4 * GIB and "job/memory.max" in got.limit
    fake_host(monkeypatch, tmp_path, "0::/job\n", {"job/memory.max": "max", "job/memory.swap.max": "max"}, 0)
    assert host_memory.available_memory() == host_memory.Memory(20 * GIB, "MemAvailable + SwapFree")


def test_the_trainer_in_a_4_gib_cgroup_refuses_the_16m_probe(tmp_path, monkeypatch, tiny_data, overrides, caplog):
    """The issue's probe (SIGKILLed without a word in a 4 GiB cgroup), with the limit read from a v1 tree."""
    from test_train_memory import LONG

    limit = tmp_path / "cg"
    fake_host(monkeypatch, limit, "4:memory:/probe\n", {"memory/probe/memory.limit_in_bytes": str(4 * GIB)}, 0)

    def started(*args, **kwargs):
        raise AssertionError("the run started although it cannot fit")

    monkeypatch.setattr(trainer, "Trainer", started)
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        assert trainer.main(None, overrides(run, tiny_data, **LONG)) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "train.seq_len=16777216" in line and f"4.0 GiB (cgroup {limit}/memory/probe/memory.limit_in_bytes" in line
    assert not run.exists()

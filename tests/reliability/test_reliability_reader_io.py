"""The trainer's reader writes nothing while it reads a local dataset: measured with the kernel's own per-process
counters (``/proc/self/io``: ``write_bytes``, bytes sent toward storage; ``wchar``, bytes passed to any write
call) in a forked child that does nothing but read. The same meter on the baseline of ``make bench-reader`` (the
old reader's decompressed copy in a cache directory) shows the meter sees such writes."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from pipeline.bench.reader import DiskCacheReader, io_counters, read_all
from pipeline.data.reader import MDSReader

pytestmark = pytest.mark.reliability


def _measure(make: Any, results: Any) -> None:
    before = io_counters()
    tokens = read_all(make(), epochs=2)
    after = io_counters()
    results.put((tokens, {key: after[key] - before[key] for key in ("wchar", "write_bytes")}))


def _in_child(make: Any) -> tuple[int, dict[str, int]]:
    ctx = multiprocessing.get_context("fork")  # the child shares this process's imports
    results = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(make, results))
    proc.start()
    got = results.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return got


def test_reading_two_epochs_writes_no_byte(data, tmp_path):
    raw = sum(int(s.file_pairs[0][0].bytes) for s in MDSReader(str(data), "train", None).shards)
    tokens, written = _in_child(lambda: MDSReader(str(data), "train", str(tmp_path / "cache")))
    assert tokens > 0 and written["write_bytes"] == 0
    assert written["wchar"] < 4096, "at most the result message on the pipe"
    assert not (tmp_path / "cache").exists()
    cache = tmp_path / "old"
    cache.mkdir()
    old_tokens, old_written = _in_child(lambda: DiskCacheReader(str(data), "train", cache))
    assert old_tokens == tokens and old_written["write_bytes"] >= raw, "the meter sees a decompressed copy"

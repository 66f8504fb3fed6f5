"""Peak memory of streamed evaluation: the chunk K/V stay on disk, RSS grows far slower than the length."""

import pytest

from pipeline.bench.eval import run_one


def _peak_rss(export, length, out):
    row = run_one(export, length, out, timeout=600, overrides=["segment=2048"])
    assert "error" not in row, row
    return row["peak_rss_mib"]


@pytest.mark.slow
def test_rss_16k_vs_256k(tiny_export, tmp_path):
    small = _peak_rss(tiny_export, 16384, tmp_path / "16k")
    large = _peak_rss(tiny_export, 262144, tmp_path / "256k")
    assert large < 2 * small, (small, large)


KV_PER_TOKEN = 2 * 2 * 32 * 4
"""The tiny export's chunk memory per token: k and v, 2 heads of 32 floats."""
KEYS_PER_TOKEN = 64 * 4 / 16
"""A d_model=64 landmark key per chunk of 16 tokens."""


def test_streamed_prefix_keeps_only_landmark_keys_in_ram(tiny_export, tmp_path):
    """The passkey prefix path (memory_only segments, chunk K/V spilled to disk from the first chunk), through the
    per-token benchmark: the store's RAM part is the landmark keys alone, every chunk's K/V is on disk."""
    from pipeline.bench.eval import run_per_token

    report = run_per_token([8192, 32768], window=8192, segment=4096, checkpoint=str(tiny_export), offload_dir=tmp_path)
    for row in report["rows"]:
        assert row["store_disk_mib"] == row["position"] * KV_PER_TOKEN / 2**20
        assert row["store_ram_mib"] == round(row["position"] * KEYS_PER_TOKEN / 2**20, 1)
    assert report["rows"][0]["ratio"] == 1.0 and report["rows"][1]["tokens_per_s"] > 0


@pytest.mark.slow
def test_resident_memory_grows_far_slower_than_the_spilled_store(tiny_export, tmp_path):
    """8x the streamed tokens: the process's resident memory grows by far less than the K/V written to disk (after
    the first 32K tokens, which include the allocator's warm-up)."""
    from pipeline.bench.eval import run_per_token

    rows = run_per_token([32768, 262144], window=32768, checkpoint=str(tiny_export), offload_dir=tmp_path)["rows"]
    written = (rows[1]["store_disk_mib"] - rows[0]["store_disk_mib"]) * 2**20
    assert written == (262144 - 32768) * KV_PER_TOKEN
    assert (rows[1]["rss_mib"] - rows[0]["rss_mib"]) * 2**20 < written / 8, rows

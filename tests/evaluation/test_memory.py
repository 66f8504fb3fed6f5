"""Peak memory grows far slower than length: 16x the tokens costs well under 2x the RSS (slow: ~1-2 min)."""

import pytest

from pipeline.evaluation.bench import run_one


def _peak_rss(export, length, out):
    row = run_one(export, length, out, timeout=600, overrides=["segment=2048"])
    assert "error" not in row, row
    return row["peak_rss_mib"]


@pytest.mark.slow
def test_rss_16k_vs_256k(tiny_export, tmp_path):
    small = _peak_rss(tiny_export, 16384, tmp_path / "16k")
    large = _peak_rss(tiny_export, 262144, tmp_path / "256k")
    assert large < 2 * small, (small, large)

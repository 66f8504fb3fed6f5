"""Peak memory grows far slower than length: 16x the tokens costs well under 2x the RSS (slow: ~1-2 min)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _peak_rss(export, length, out):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "eval.py"),
            "--checkpoint",
            str(export),
            "--task",
            "passkey",
            "--out",
            str(out),
            f"lengths=[{length}]",
            "samples=1",
            "depths=[0.5]",
            "progress=false",
            "offload_mb=0",
            "segment=2048",
        ],
        check=True,
        capture_output=True,
    )
    return json.loads((out / "passkey.json").read_text())["peak_rss_mib"]


@pytest.mark.slow
def test_rss_16k_vs_256k(tiny_export, tmp_path):
    small = _peak_rss(tiny_export, 16384, tmp_path / "16k")
    large = _peak_rss(tiny_export, 262144, tmp_path / "256k")
    assert large < 2 * small, (small, large)

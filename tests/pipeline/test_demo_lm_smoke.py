"""``make demo-lm-smoke`` end to end (prep, five 2-rank DeepSpeed trainings, their evals, the report), then a
rerun that finds every stage done. Minutes: behind the ``slow`` marker (``make test-slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _demo_lm(run_dir: Path, data: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch/demo_lm.py", "--config", "configs/demo_lm/smoke.yaml"]
    cmd += [f"run_dir={run_dir}", f"data={data}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)


def test_demo_lm_smoke_runs_and_resumes(tmp_path):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    first = _demo_lm(run_dir, data)
    assert first.returncode == 0, first.stderr[-3000:]
    payload = json.loads((run_dir / "ppl.json").read_text())
    rows = [r for r in payload["results"] if r["kind"] == "context"]
    assert sorted({r["model"] for r in rows}) == ["baseline", "full", "gca", "gca_mix", "gca_random"]
    assert all(r.get("far_recall_tokens") is not None for r in rows if r["model"].startswith("gca"))
    # Every model scored the same tokens of the same held-out documents at every length.
    assert {(r["length"], r["tokens"], r["documents"]) for r in rows} == {(512, 6 * 256, 6), (2048, 6 * 256, 6)}
    held_out = {d["name"] for d in payload["documents"]}
    assert held_out == {"asyncio", "ctypes", "email", "multiprocessing", "unittest", "xml"}
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["config"]["exclude"] == [f"{name}/*" for name in sorted(held_out)]
    for model in ("gca", "gca_mix", "gca_random", "baseline", "full"):
        assert (run_dir / model / "export" / "model.safetensors").is_file()
    for family in ("single", "multikey", "multivalue", "multiquery", "vt"):
        assert (run_dir / "eval" / "gca_mix" / "mix" / family / "passkey.json").is_file()
    assert "## The mix's task families" in (run_dir / "results.md").read_text()
    assert "## Claims" in (run_dir / "results.md").read_text()
    timings = json.loads((run_dir / "timings.json").read_text())
    second = _demo_lm(run_dir, data)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("already done") == len(timings) - 1  # every subprocess stage; the documents exist
    assert json.loads((run_dir / "timings.json").read_text()) == timings

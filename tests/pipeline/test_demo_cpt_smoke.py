"""``make demo-cpt-smoke`` end to end (prep, the dense Llama, both conversions, two 2-rank DeepSpeed stages, every
eval, the report), then a rerun that finds every stage done. Minutes: behind the ``slow`` marker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from model.convert import parameter_role

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _demo_cpt(run_dir: Path, data: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch/demo_cpt.py", "--config", "configs/demo_cpt/smoke.yaml"]
    cmd += [f"run_dir={run_dir}", f"data={data}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)


def test_demo_cpt_smoke_runs_and_resumes(tmp_path):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    first = _demo_cpt(run_dir, data)
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    ppl = {(r["model"], r["length"]) for r in results["ppl"]}
    assert ppl == {("dense", 512), *((m, n) for m in ("converted", "stage1", "stage2") for n in (512, 1024))}
    passkey = {(r["model"], r["length"]) for r in results["passkey"]}
    assert passkey == {("dense", 512), ("converted", 512), ("stage1", 512), ("stage2", 512), ("stage2", 1024)}
    assert results["dense_check"]["max_abs_diff"] < 1e-4
    # Stage 1 (optim.trainable=new, converted by the trainer from the dense folder) left every dense weight as the
    # converter's CLI placed it; stage 2 (all) moved them.
    converted = load_file(run_dir / "converted" / "export" / "model.safetensors")
    stage1 = load_file(run_dir / "stage1" / "export" / "model.safetensors")
    stage2 = load_file(run_dir / "stage2" / "export" / "model.safetensors")
    dense_names = [n for n in converted if parameter_role(n) == "dense"]
    new_names = [n for n in converted if parameter_role(n) != "dense"]
    assert dense_names and new_names
    assert all(stage1[n].equal(converted[n]) for n in dense_names)
    assert any(not stage1[n].equal(converted[n]) for n in new_names)
    assert any(not stage2[n].equal(stage1[n]) for n in dense_names)
    markdown = (run_dir / "results.md").read_text()
    assert "## Perplexity of the same held-out tokens by context" in markdown and "## Passkey" in markdown
    timings = json.loads((run_dir / "timings.json").read_text())
    second = _demo_cpt(run_dir, data)
    assert second.returncode == 0, second.stderr[-3000:]
    in_process = {"eval-documents", "check-dense"}
    assert second.stderr.count("already done") == len(set(timings) - in_process)
    assert json.loads((run_dir / "timings.json").read_text()) == timings

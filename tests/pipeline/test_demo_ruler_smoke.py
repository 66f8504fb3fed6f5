"""``make demo-ruler-smoke`` end to end (prep of the built-in corpus, both 2-rank DeepSpeed stages of the main run and
of a second seed, passkey, ppl, both RULER runs of each seed, the report), then a rerun that finds every stage done.
Minutes: behind the ``slow`` marker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, timeout=1800)


def test_demo_ruler_smoke_runs_and_resumes(tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    prep = _run(["launch/prep.py", "--config", "configs/data/default.yaml", f"output={data}"])
    assert prep.returncode == 0, prep.stderr[-3000:]
    demo = ["launch/demo.py", "--config", "configs/demo_ruler/smoke.yaml", f"run_dir={run_dir}", f"data={data}"]
    first = _run(demo)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = json.loads((run_dir / "ruler.json").read_text())["results"]
    tasks = ["niah_single_1", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"]
    assert [(r["task"], r["length"]) for r in rows] == [*((t, 1024) for t in tasks), ("niah_multiquery", 2048)]
    multi = next(r for r in rows if r["task"] == "niah_multivalue")
    assert multi["retrieval"]["g0"]["every_asked_needle"]["n"] == 1
    seeds = json.loads((run_dir / "seeds.json").read_text())
    assert {(r["seed"], r["task"], r["length"]) for r in seeds["ruler"]} == {
        (seed, task, length)
        for seed in (0, 1)
        for task, length in [*((t, 1024) for t in tasks), ("niah_multiquery", 2048)]
    }
    assert "across training seeds (`seed_ruler`)" in (run_dir / "results.md").read_text()
    # the first stage trained single pass keys only; the second every number family and the UUID variant, from the
    # first one's weights
    single = OmegaConf.load(run_dir / "gca" / "single" / "config.yaml")
    mixed = OmegaConf.load(run_dir / "gca" / "mixed" / "config.yaml")
    assert {k for k, w in single.data.retrieval_mix.families.items() if w > 0} == {"single"}
    assert {k for k, w in mixed.data.retrieval_mix.families.items() if w > 0} == {
        "single",
        "multikey",
        "multivalue",
        "multiquery",
        "uuid_single",
    }
    # the smoke's tiny batch overrides the recipe's per-stage batch in both stages
    assert (single.train.global_batch, mixed.train.global_batch) == (4, 4)
    assert mixed.checkpoint.init_from == str(run_dir / "gca" / "single" / "export")
    export = run_dir / "seeds" / "seed1" / "gca" / "mixed" / "export" / "model.safetensors"
    before = export.stat().st_mtime_ns
    again = _run(demo)
    assert again.returncode == 0, again.stderr[-3000:]
    assert export.stat().st_mtime_ns == before  # every stage was found done

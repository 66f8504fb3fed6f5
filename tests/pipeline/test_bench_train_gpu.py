"""``make bench-gpu`` (``pipeline.bench.train_gpu``): its arithmetic, its refusals, and a CPU dry run of every
configuration through the trainer's engines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.train_gpu import ARCHS, ENGINES, _busy_fraction, ratios
from pipeline.cli.bench_gpu import main

ROOT = Path(__file__).resolve().parents[2]


def test_busy_fraction_is_the_union_of_overlapping_kernels():
    # [0, 10] and [5, 20] overlap (20 us together), [30, 40] stands apart (10 us), [32, 35] lies inside it.
    assert _busy_fraction([(30, 40), (0, 10), (5, 20), (32, 35)], 100) == pytest.approx(0.30)
    assert _busy_fraction([], 100) == 0.0


def test_ratios_pair_gca_with_the_baselines_and_engines_with_plain():
    rows = [
        {"arch": "gca", "engine": "plain", "step_s": 1.0},
        {"arch": "gca", "engine": "zero1", "step_s": 1.5},
        {"arch": "swa", "engine": "plain", "step_s": 0.8},
        {"arch": "full", "engine": "plain", "step_s": 2.0},
        {"arch": "full", "engine": "zero1", "error": "no result within 50 s"},
    ]
    assert ratios(rows) == {
        "gca/swa plain": pytest.approx(1.25),
        "gca/full plain": pytest.approx(0.5),
        "zero1/plain gca": pytest.approx(1.5),
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--one", "gca", "zero3"],
        ["--steps", "0"],
        ["model.arch"],
        ["--micro-batch", "-1"],
        ["model.nope=1"],
        ["--agreement", "-1"],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.gpucheck
@pytest.mark.slow  # 20-80 s: make test-gpu-check, not the default tier
def test_cpu_dry_run_measures_every_configuration(tmp_path):
    out = tmp_path / "bench_gpu.json"
    cmd = [sys.executable, "launch/bench_gpu.py", "--cpu", "--steps", "1", "--timeout-s", "300", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["arch"], r["engine"]) for r in result["rows"]] == [(a, e) for a in ARCHS for e in ENGINES]
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["micro_batch"] * 256 / row["step_s"])
    assert set(result["ratios"]) == {f"gca/{o} {e}" for o in ("swa", "full") for e in ENGINES} | {
        f"{e}/plain {a}" for e in ("zero1", "fsdp2") for a in ARCHS
    }


@pytest.mark.gpucheck
@pytest.mark.slow  # 20-80 s: make test-gpu-check, not the default tier
def test_cpu_dry_run_of_the_compiled_loss_agreement(tmp_path):
    """``--agreement``: the GCA step eager and with ``train.compile=blocks`` (inductor's CPU code here), the same
    losses within fp32 rounding (measured 6.1e-8 relative over 3 steps)."""
    out = tmp_path / "agreement.json"
    cmd = [sys.executable, "launch/bench_gpu.py", "--cpu", "--agreement", "3", "--timeout-s", "900", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["eager"]) == len(result["compiled"]) == 3 and result["eager"][2] < result["eager"][0]
    assert result["max_rel_diff"] < 1e-5

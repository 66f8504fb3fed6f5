"""``make gpu-check`` on CPU: the same stages at tiny shapes, each checked against an independent reference
(the trainer's ``metrics.jsonl``, the eval's ``passkey.json``, data prep's manifest, pytest's own collection)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.gpucheck.stages import GPU_TEST_SELECTION, gpu_test_files

pytestmark = [pytest.mark.gpucheck, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    "prep",
    "kernel_bench",
    "kernel_registers",
    "gpu_tests",
    "train_gca_zero1",
    "train_gca_fsdp2",
    "train_swa_zero1",
    "passkey",
    "train_full_zero1",
]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("gpu-check")
    out, work = base / "out", base / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "launch/gpu_check.py", "--cpu", "--out", str(out), "--work", str(work)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = json.loads((out / "gpu-check.json").read_text())
    return {"rc": done.returncode, "stderr": done.stderr, "report": report, "out": out, "work": work}


def test_every_stage_runs_ok_on_cpu(dry_run):
    report = dry_run["report"]
    not_ok = {
        n: {k: r.get(k) for k in ("status", "reason", "log_tail")}
        for n, r in report["stages"].items()
        if r["status"] != "ok"
    }
    assert not not_ok, json.dumps(not_ok, indent=1)[-6000:]
    assert dry_run["rc"] == 0, dry_run["stderr"][-2000:]
    assert list(report["stages"]) == STAGES
    assert report["mode"] == "cpu-dry-run" and report["machine"]["cuda_available"] is False
    for name, stage in report["stages"].items():
        assert stage["seconds"] > 0 and stage["timeout_s"] > 0 and stage["command"], name
    assert report["summary"]["stages_ok"] == sorted(STAGES) and report["summary"]["stages_not_ok"] == []
    log = (dry_run["out"] / "gpu-check.log").read_text()
    assert all(f"== stage {name}: ok in" in log for name in STAGES)


def test_training_numbers_match_the_trainers_metrics(dry_run):
    for name in STAGES:
        if not name.startswith("train_"):
            continue
        numbers = dry_run["report"]["stages"][name]["numbers"]
        rows = [json.loads(ln) for ln in (dry_run["work"] / "train" / name / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r and "step" in r]
        assert numbers["steps"] == len(rows) == 4
        assert numbers["losses"] == [r["loss"] for r in rows]
        assert numbers["loss_first"] == rows[0]["loss"] and numbers["loss_last"] == rows[-1]["loss"]
        # the first step (compile) apart, the steady state the median of the others, as the trainer logs them
        assert numbers["first_step_time_s"] == rows[0]["first_step_time_s"] == rows[0]["step_time_s"]
        assert numbers["step_time_s"] == rows[-1]["steady_step_time_s"]
        assert numbers["step_time_s"] == statistics.median(r["step_time_s"] for r in rows[1:])
        assert numbers["tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in rows[1:])
        assert numbers["loss_finite"] is True and numbers["peak_mem_gb"] > 0
    summary = dry_run["report"]["summary"]
    swa = dry_run["report"]["stages"]["train_swa_zero1"]["numbers"]["step_time_s"]
    gca = dry_run["report"]["stages"]["train_gca_zero1"]["numbers"]["step_time_s"]
    assert summary["gca_vs_swa_step_time"] == pytest.approx(gca / swa)
    # The dry run trains in fp32: FSDP2 and ZeRO-1 on one process follow the same loss curve.
    fsdp2, zero1 = (dry_run["report"]["stages"][n]["numbers"]["losses"] for n in ("train_gca_fsdp2", "train_gca_zero1"))
    assert summary["fsdp2_vs_zero1_loss_max_rel_diff"] == max(abs(a - b) / abs(b) for a, b in zip(fsdp2, zero1))
    assert summary["fsdp2_vs_zero1_loss_max_rel_diff"] < 1e-4


def test_kernel_passkey_prep_and_test_tier_numbers(dry_run):
    stages = dry_run["report"]["stages"]
    kernel = stages["kernel_bench"]["numbers"]
    assert kernel["max_abs_err_vs_naive"] < 1e-4  # fp32 Triton (interpreter) vs the reference: same maths
    assert kernel["speedup_vs_naive"]["fwd_bwd"] > 0 and kernel["time_vs_flash"]["fwd_bwd"] > 0
    assert set(kernel["impls"]) >= {"triton_gca", "naive_gca", "sdpa_flash_flattened"}
    assert kernel["targets"]["judged"] is False

    passkey = stages["passkey"]["numbers"]
    written = json.loads((dry_run["work"] / "passkey" / "passkey.json").read_text())["results"][0]
    assert passkey["length"] == written["length"] == 65536 and passkey["tokens_per_s"] == written["tokens_per_s"]
    assert passkey["peak_gpu_mib"] is None and passkey["accuracy_meaningful"] is False

    manifest = json.loads((dry_run["work"] / "data" / "manifest.json").read_text())
    assert stages["prep"]["numbers"]["train_tokens"] == manifest["splits"]["train"]["tokens"] > 1_000_000

    def collect(*select: str) -> list[str]:
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
        done = subprocess.run([*cmd, *select, *gpu_test_files()], cwd=ROOT, capture_output=True, text=True, timeout=300)
        return [ln for ln in done.stdout.splitlines() if "::" in ln]

    tier, chosen = collect(), collect("-k", GPU_TEST_SELECTION)
    numbers = stages["gpu_tests"]["numbers"]
    assert numbers["tests"] == numbers["skipped"] == len(chosen) and numbers["passed"] == 0
    # The stage runs a proper subset of the GPU tier that keeps at least one case of every GPU test function.
    assert set(chosen) < set(tier)
    assert {t.split("[")[0] for t in chosen} == {t.split("[")[0] for t in tier}
    assert {"torch.bfloat16", "torch.float32"} <= {t.rsplit("-", 1)[-1].rstrip("]") for t in chosen}


def test_register_comparison_runs_on_the_committed_table(dry_run):
    from pipeline.gpucheck import kernel_compile as kc
    from pipeline.gpucheck import registers

    numbers = dry_run["report"]["stages"]["kernel_registers"]["numbers"]
    table = (ROOT / "docs/results/gpu-compile.md").read_text()
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines() if ln.startswith("| ")]
    configs = [c for c in cells if c[0] in kc.KERNELS and c[1] == "sm_90"]
    column = registers.ROW_FIELDS.index("registers")  # the table's leading columns, in order
    assert numbers["metadata_source"] == "committed" and numbers["target"] == "sm_90"
    # The stand-in device reads the table's own numbers: every row is the same unless the code no longer makes it
    # (stale until make test-gpu-compile regenerates the table; tests/gpu_check/test_gpu_compile.py says which).
    assert numbers["configs"] == numbers["same"] + numbers["stale"] == len(configs) > 0
    assert numbers["differs"] == numbers["spills"] == numbers["failed"] == 0
    assert numbers["table_holds"] is (numbers["stale"] == 0)
    assert [r["committed_registers"] for r in numbers["rows"]] == [int(c[column]) for c in configs]
    same = [r for r in numbers["rows"] if r["status"] == "same"]
    assert all(r["device_registers"] == r["committed_registers"] for r in same)


def test_the_dry_runs_json_publishes(dry_run, tmp_path):
    from pipeline.gpucheck.publish import RESULTS_BEGIN, RESULTS_END

    docs = tmp_path / "gpu-check.md"
    docs.write_text(f"{RESULTS_BEGIN}\n{RESULTS_END}\n")
    cmd = [sys.executable, "launch/gpu_check.py", "--publish", str(dry_run["out"] / "gpu-check.json")]
    cmd += ["--docs", str(docs), "--results-dir", str(tmp_path / "results")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = dry_run["report"]
    (written,) = (tmp_path / "results").iterdir()
    assert written.name == f"{report['started'][:10]}-cpu-dry-run.json"
    assert json.loads(written.read_text()) == report
    assert report["source"]["commit"] and report["source"]["commit"][:10] in docs.read_text()
    rows = [ln.split(" | ") for ln in docs.read_text().splitlines() if ln.startswith("| ") and " | ok | " in ln]
    assert [r[0].lstrip("| ") for r in rows] == STAGES
    assert [float(r[2]) for r in rows] == [report["stages"][n]["seconds"] for n in STAGES]

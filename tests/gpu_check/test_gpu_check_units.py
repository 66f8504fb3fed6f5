"""Fast checks of the GPU-readiness tooling: the wheel list and folder rules, the stage runner's time boxes and
failure isolation, and the command line's refusals before any work (default tier, a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.gpucheck import wheels
from pipeline.gpucheck.runner import Runner
from pipeline.gpucheck.stages import Plan, Stage, StageError, gpu_test_files, kernel_stage

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_list_pins_one_version_of_each_and_no_gpu_stack():
    pins = wheels.read_pins()
    lock = {
        wheels.normalize(ln.split("==")[0]): ln.split("==")[1].strip()
        for ln in (ROOT / "requirements.lock").read_text().splitlines()
        if "==" in ln and not ln.startswith("#")
    }
    assert {p.key for p in pins} >= {"deepspeed", "omegaconf", "mosaicml_streaming", "pydantic", "pydantic_core"}
    assert not [p for p in pins if p.key.startswith(("torch", "triton", "nvidia"))]
    assert {p.key: p.version for p in pins} == {p.key: lock[p.key] for p in pins}  # the versions we test with
    image = {wheels.normalize(ln) for ln in (ROOT / "configs/gpu/image.txt").read_text().split() if ln[0] != "#"}
    assert not image & {p.key for p in pins}, "a carried package the image already has"


@pytest.mark.parametrize("line", ["deepspeed", "deepspeed==", "x==1 build=maybe", "x==1 a b"])
def test_bad_wheel_list_line_is_named(tmp_path, line):
    path = tmp_path / "wheels.txt"
    path.write_text(f"# comment\n{line}\n")
    with pytest.raises(wheels.WheelError, match=rf"wheels.txt:2: '{line}'"):
        wheels.read_pins(path)


def test_wheel_tags_fit_only_their_python():
    assert wheels.fits("zstd-1.5.7.2-cp312-cp312-linux_x86_64.whl", "3.12")
    assert not wheels.fits("zstd-1.5.7.2-cp312-cp312-linux_x86_64.whl", "3.11")
    assert wheels.fits("deepspeed-0.19.8-py3-none-any.whl", "3.11")
    assert wheels.fits("brotli-1.2.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "3.12")
    assert not wheels.fits("brotli-1.2.1-cp312-cp312-macosx_11_0_arm64.whl", "3.12")


def test_foreign_or_second_version_wheel_is_refused_before_downloads(tmp_path):
    pins = [wheels.Pin("hjson", "3.1.0", None)]
    (tmp_path / "hjson-3.0.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(wheels.WheelError, match=r"hjson-3.0.0-py3-none-any.whl is not hjson==3.1.0"):
        wheels.collect(pins, "3.12", tmp_path)
    (tmp_path / "hjson-3.0.0-py3-none-any.whl").unlink()
    (tmp_path / "six-1.17.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(wheels.WheelError, match=r"six-1.17.0-py3-none-any.whl is not in configs/gpu/wheels.txt"):
        wheels.collect(pins, "3.12", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["six-1.17.0-py3-none-any.whl"]  # nothing deleted


def _stage(name: str, code: str, box: float = 30, needs: tuple[str, ...] = (), parse=None) -> Stage:
    return Stage(name, name, [sys.executable, "-c", code], box, parse or (lambda: {"ran": name}), needs)


def test_runner_time_boxes_isolates_failures_and_skips_dependants(tmp_path):
    marker = tmp_path / "child-alive"
    # The slow stage starts a grandchild that would write the marker after the box: the whole group must die.
    child = f"import time; time.sleep(4); open({str(marker)!r}, 'w')"
    slow = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"

    def bad_numbers() -> dict:
        raise StageError("metrics.jsonl has no training steps")

    stages = [
        _stage("ok", "print('fine')"),
        _stage("crash", "import sys; print('boom'); sys.exit(3)"),
        _stage("slow", slow, box=2),
        _stage("after_crash", "print(1)", needs=("crash",)),
        _stage("silent_failure", "print(1)", parse=bad_numbers),
        _stage("last", "print('still runs')"),
    ]
    plan = Plan(cuda=False, work=tmp_path / "work", python=sys.executable)
    start = time.monotonic()
    report = Runner(plan, tmp_path / "out", budget_s=120).run(stages)
    assert time.monotonic() - start < 60
    res = report["stages"]
    assert {n: r["status"] for n, r in res.items()} == {
        "ok": "ok",
        "crash": "failed",
        "slow": "timeout",
        "after_crash": "skipped",
        "silent_failure": "failed",
        "last": "ok",
    }
    assert res["crash"]["exit_code"] == 3 and res["crash"]["log_tail"] == ["boom"]
    assert "needs crash" in res["after_crash"]["reason"]
    assert "no training steps" in res["silent_failure"]["reason"]
    on_disk = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert on_disk["stages"] == json.loads(json.dumps(res)) and on_disk["summary"]["stages_not_ok"] == [
        "after_crash",
        "crash",
        "silent_failure",
        "slow",
    ]
    time.sleep(5)
    assert not marker.exists(), "a timed-out stage's child survived"


def test_runner_skips_what_the_budget_cannot_fit(tmp_path):
    plan = Plan(cuda=False, work=tmp_path / "work", python=sys.executable)
    report = Runner(plan, tmp_path / "out", budget_s=10).run([_stage("only", "print(1)")])
    assert report["stages"]["only"]["status"] == "skipped"
    assert report["stages"]["only"]["reason"].startswith("time budget")


def test_gpu_tier_files_are_the_marked_ones():
    files = gpu_test_files()
    assert "tests/kernels/test_gca_triton_gpu.py" in files and "tests/gpu_check/test_model_gpu.py" in files
    assert all("pytest.mark.gpu" in (ROOT / f).read_text() for f in files)


def test_kernel_stage_and_make_bench_kernels_run_one_benchmark(tmp_path, capsys):
    """The ``kernel_bench`` stage's command writes the JSON the dry run reads; the same module without ``--out``
    prints ``make bench-kernels``'s table (both at the tiny interpreter shapes here)."""
    from pipeline.bench import kernels

    stage = kernel_stage(Plan(cuda=False, work=tmp_path, python=sys.executable))
    done = subprocess.run(stage.cmd, cwd=ROOT, env={**os.environ, **stage.env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = stage.parse()
    assert set(result["impls"]) == {"triton_gca", "naive_gca", "sdpa_flash_flattened"}
    assert result["max_abs_err_vs_naive"] < 1e-4 and result["targets"]["judged"] is False
    assert set(result["speedup_vs_naive"]) == set(result["time_vs_flash"]) == {"fwd", "fwd_bwd"}

    assert kernels.main(["--tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GCA benchmark on cpu") and lines[1].split()[0] == "implementation"
    assert [line[:30].strip() for line in lines[2:]] == [
        "triton (fused GCA)",
        "naive_gca (fp32 einsum)",
        "SDPA (flattened keys)",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--export", "no/such/export"], "--export no/such/export is not a model export"),
        (["--data", "."], "--data . is not a complete prepared dataset"),
        (["--budget-s", "0"], "--budget-s 0.0 must be > 0"),
    ],
)
def test_bad_arguments_stop_before_any_work(tmp_path, args, message):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "launch/gpu_check.py", "--cpu", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"gpu-check: error: {done.stderr.split('error: ', 1)[1].strip()}"]
    assert message in done.stderr
    assert not out.exists()


def test_the_gpu_checks_tiny_model_is_the_tiny_preset():
    """stages.py imports only the standard library, so it spells the tiny shape as overrides: they must stay the
    ``tiny`` preset's values."""
    import yaml

    from model import preset
    from pipeline.gpucheck.stages import TINY_MODEL

    tiny = preset("tiny")
    model_keys = [item.removeprefix("model.").split("=", 1) for item in TINY_MODEL if item.startswith("model.")]
    assert len(model_keys) >= 10
    assert {key: yaml.safe_load(value) for key, value in model_keys} == {
        key: getattr(tiny, key) for key, _ in model_keys
    }

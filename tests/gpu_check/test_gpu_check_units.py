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
    assert set(result["speedup_vs_naive"]) == set(result["time_vs_flash"]) == {"fwd", "fwd_bwd", "bwd"}

    assert kernels.main(["--tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GCA benchmark on cpu") and lines[1].split()[0] == "implementation"
    assert [line[:30].strip() for line in lines[2:]] == [
        "triton (fused GCA)",
        "naive_gca (fp32 einsum)",
        "SDPA flash (flattened keys)",
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


def test_runner_keeps_the_later_stages_expected_time_from_a_hang(tmp_path, monkeypatch):
    """A hanging stage is cut at the budget left once the later stages' expected seconds are kept aside, so the
    stage after it still runs; a later stage that will be skipped (its prerequisite failed) keeps nothing."""
    from pipeline.gpucheck import runner

    monkeypatch.setattr(runner, "MIN_STAGE_S", 2.0)
    monkeypatch.setattr(runner, "machine", dict)  # the budget starts before the machine probe (seconds of torch)
    hang = Stage("hang", "hang", [sys.executable, "-c", "import time; time.sleep(60)"], 30, lambda: {}, expect_s=1)
    doomed = _stage("doomed", "print(1)", needs=("crash",))
    doomed.expect_s = 100  # kept aside, the hang would get only MIN_STAGE_S
    after = _stage("after", "print('ran')")
    after.expect_s = 3
    stages = [_stage("crash", "import sys; sys.exit(1)"), hang, doomed, after]
    plan = Plan(cuda=False, work=tmp_path / "work", python=sys.executable)
    report = Runner(plan, tmp_path / "out", budget_s=9).run(stages)
    res = report["stages"]
    assert {n: r["status"] for n, r in res.items()} == {
        "crash": "failed",
        "hang": "timeout",
        "doomed": "skipped",
        "after": "ok",
    }
    # 9 s of budget, minus the crash's fraction of a second, minus 3 s kept for "after"
    assert 4.5 <= res["hang"]["timeout_s"] <= 6.0 and res["hang"]["expect_s"] == 1


def test_budget_arithmetic_fits_the_default_budget():
    from pipeline.gpucheck.stages import CUDA_BUDGET, DEFAULT_CUDA_BUDGET_S, ORDER, build

    assert list(CUDA_BUDGET) == list(ORDER)
    assert sum(expect for _, expect in CUDA_BUDGET.values()) <= DEFAULT_CUDA_BUDGET_S
    assert all(0 < expect <= box for box, expect in CUDA_BUDGET.values())
    stages = build(Plan(cuda=True, work=Path("/nonexistent"), python=sys.executable))
    assert [(s.name, s.box_s, s.expect_s) for s in stages] == [(n, *CUDA_BUDGET[n]) for n in ORDER]


def _metrics(run_dir: Path, step_times: list[float], compiles: list[int]) -> None:
    """A metrics.jsonl as the trainer writes it with the compile budget: first_step_time_s on the first step,
    steady_step_time_s (median since the first) on every later one, plus a validation row without a loss."""
    run_dir.mkdir(parents=True)
    rows = []
    for i, (t, c) in enumerate(zip(step_times, compiles)):
        row = {"step": i + 1, "loss": 9.0 - i, "step_time_s": t, "tokens": 100, "tokens_per_s": 100 / t, "mfu": t}
        row["compiles"] = c
        if i == 0:
            row["first_step_time_s"] = t
        else:
            later = sorted(step_times[1 : i + 1])
            mid = len(later) // 2
            row["steady_step_time_s"] = later[mid] if len(later) % 2 else (later[mid - 1] + later[mid]) / 2
        rows.append(row)
    rows.insert(2, {"step": 2, "val_loss": 5.0})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_training_numbers_separate_the_compile_step_from_the_steady_state(tmp_path):
    from pipeline.gpucheck.stages import train_metrics

    _metrics(tmp_path / "run", [40.0, 0.2, 0.3, 0.25, 0.1], [12, 0, 1, 0, 0])
    n = train_metrics(tmp_path / "run")
    assert n["steps"] == 5 and n["first_step_time_s"] == 40.0
    assert n["step_time_s"] == pytest.approx(0.225)  # median of 0.2, 0.3, 0.25, 0.1: the compile step left out
    assert n["tokens_per_s"] == pytest.approx(450.0)  # median of 500, 333, 400, 1000 tokens/s
    assert n["mfu_sparse_aware"] == pytest.approx(0.225)
    assert n["compiles_after_first_step"] == 1 and n["steps_total_s"] == pytest.approx(40.85)
    assert n["losses"] == [9.0, 8.0, 7.0, 6.0, 5.0] and n["loss_falling"] is True


def test_passkey_numbers_pool_the_depths_and_say_when_accuracy_means_nothing(tmp_path):
    from pipeline.gpucheck.stages import passkey_stage

    export = tmp_path / "demo-export"
    with_export = passkey_stage(Plan(cuda=True, work=tmp_path, python=sys.executable, export=str(export)))
    assert "depths=[0.0,0.5,1.0]" in with_export.cmd and "lengths=[1048576]" in with_export.cmd
    assert with_export.needs == ()
    rows = [
        {"length": 1048576, "depth": d, "accuracy": a, "n": 1, "seconds": s, "tokens_per_s": 1048576 / s}
        for d, a, s in [(0.0, 1.0, 10.0), (0.5, 0.0, 20.0), (1.0, 1.0, 30.0)]
    ]
    (tmp_path / "passkey").mkdir()
    probe = {"rows": rows, "peak_gpu_mib": 1234.5, "peak_rss_mib": 99.0}
    (tmp_path / "passkey" / "probe.json").write_text(json.dumps(probe))
    n = with_export.parse()
    assert n["samples"] == 3 and n["accuracy"] == pytest.approx(2 / 3) and n["accuracy_meaningful"] is True
    assert n["tokens_per_s"] == pytest.approx(3 * 1048576 / 60, abs=0.1) and n["peak_gpu_mib"] == 1234.5
    assert n["accuracy_note"] is None

    own = passkey_stage(Plan(cuda=True, work=tmp_path, python=sys.executable))
    assert "depths=[0.5]" in own.cmd and own.needs == ("train_gca_zero1",)
    n = own.parse()
    assert n["accuracy_meaningful"] is False and "20 steps" in n["accuracy_note"]
    assert "speed and memory only" in own.what


def test_source_comes_from_git_else_from_the_stamp(tmp_path, monkeypatch):
    from pipeline.gpucheck import runner

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert runner.source_info()["commit"] == head and runner.source_info()["from"] == "git"
    stamp = tmp_path / "wheels" / runner.STAMP_NAME
    written = runner.write_stamp(stamp)
    assert written["commit"] == head and json.loads(stamp.read_text())["commit"] == head

    copy = tmp_path / "device-copy"  # a working tree without .git, as the device gets it
    copy.mkdir()
    monkeypatch.setattr(runner, "ROOT", copy)
    got = runner.source_info(stamp)
    assert got["commit"] == head and got["from"] == f"stamp {runner.STAMP_NAME}"
    missing = runner.source_info(tmp_path / "none.json")
    assert missing["commit"] is None and "--stamp" in missing["from"]
    with pytest.raises(RuntimeError, match="not a git checkout"):
        runner.write_stamp(tmp_path / "x.json")


def test_stamp_command_writes_the_commit_into_the_carried_folder(tmp_path):
    """``launch/gpu_check.py --stamp --wheels DIR``: exit 0 before any wheel or torch work, the file names HEAD."""
    from pipeline.gpucheck.runner import STAMP_NAME

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cmd = [sys.executable, "launch/gpu_check.py", "--stamp", "--wheels", str(tmp_path / "whl")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "whl" / STAMP_NAME).read_text())["commit"] == head
    assert head in done.stdout and done.stderr == ""


COMPILE_TABLE = ROOT / "docs/results/gpu-compile.md"


def test_committed_register_table_parses_to_its_own_summary():
    """Every configuration row of docs/results/gpu-compile.md is read, and per kernel and target the rows number
    what the table's own summary says (its "configs" column) with the register range it states."""
    from pipeline.gpucheck import kernel_compile as kc
    from pipeline.gpucheck import registers

    text = COMPILE_TABLE.read_text()
    rows = registers.parse_table(text)
    summary = [ln.split(" | ") for ln in text.split("## Every configuration")[0].splitlines() if ln.startswith("| ")]
    titles = {title: kernel for kernel, title in kc.KERNEL_TITLES.items()}
    checked = 0
    for cells in summary[1:]:
        kernel, target = titles[cells[0].lstrip("| ")], cells[1]
        mine = [r["registers"] for r in rows if r["kernel"] == kernel and r["target"] == target]
        assert len(mine) == int(cells[2]) and f"{min(mine)}-{max(mine)}" == cells[3], cells
        checked += len(mine)
    assert checked == len(rows) > 0 and registers.committed_triton(text) is not None


def _generated_table(tmp_path: Path) -> tuple[Path, str]:
    """A table in the committed format (``kernel_compile.markdown``, its generator) for every configuration the
    code has today, with made-up numbers: the comparison tests then do not depend on the committed table being
    fresh (``test_gpu_compile.py`` checks that, under gpucompile)."""
    from pipeline.gpucheck import kernel_compile as kc

    results = [
        kc.Result(case, registers=64 + i % 100, shared_bytes=1024 * (1 + i % 50), programs_per_sm=2)
        for i, case in enumerate(kc.default_cases())
    ]
    path = tmp_path / "table.md"
    path.write_text(kc.markdown(results, 1.0, 1))
    return path, path.read_text()


def test_register_comparison_flags_what_the_device_changed(tmp_path):
    """Stand-in device metadata with four changes against the table: a register count, a spill, shared memory past
    the sm_90 limit and one configuration left unread; plus a row whose tiles the code no longer has."""
    from pipeline.gpucheck import kernel_compile as kc
    from pipeline.gpucheck import registers

    table, text = _generated_table(tmp_path)
    rows = [r for r in registers.parse_table(text) if r["target"] == "sm_90"]
    cases = registers.match_cases(rows, kc.default_cases(targets=("sm_90",)))
    ids = {i: kc.case_id(c) for i, c in cases.items()}
    fake = {ids[i]: {**registers.committed_metadata(r), "static_shared_bytes": 0} for i, r in enumerate(rows)}
    fake[ids[0]]["registers"] = rows[0]["registers"] + 8
    fake[ids[1]]["local_bytes"] = 16
    fake[ids[2]]["dynamic_shared_bytes"] = 240_000
    del fake[ids[3]]
    (tmp_path / "fake.json").write_text(json.dumps(fake))
    # The last sm_90 dk/dv row rewritten to tiles block_sizes never returns.
    last = next(ln for ln in reversed(text.splitlines()) if ln.startswith("| bwd_dkdv | sm_90 |"))
    cells = last.split(" | ")
    cells[registers.ROW_FIELDS.index("tiles")] = "512x512x512"  # cells[0] is "| kernel"
    table.write_text(text.replace(last, " | ".join(cells)))

    out = tmp_path / "registers.json"
    args = ["--table", str(table), "--out", str(out), "--fake-metadata", str(tmp_path / "fake.json")]
    assert registers.main(args) == 1  # the shared memory over the limit and the unread configuration
    report = json.loads(out.read_text())
    status = {r["config"]: (r["status"], r.get("problems"), r.get("differs")) for r in report["rows"]}
    assert report["configs"] == len(rows) and report["failed"] == 2 and report["spills"] == report["stale"] == 1
    assert report["differs"] == 1 and report["same"] == len(rows) - 5 and report["register_delta_max"] == 8
    assert report["table_holds"] is False
    got = [status[registers.compare(r, None, kc.TARGETS["sm_90"])["config"]] for r in rows[:4]]
    assert got[0] == ("differs", [], [f"registers {rows[0]['registers']} -> {rows[0]['registers'] + 8}"])
    assert got[1][0] == "spills" and "local memory 16 B" in got[1][1][0]
    assert got[2][0] == "failed" and got[2][1] == [f"shared 240000 B > {kc.TARGETS['sm_90'].shared_per_block} B"]
    assert got[3] == ("failed", ["no metadata read for it"], None)
    rewritten = [r for r in report["rows"] if " 512x512x512 " in r["config"]]
    assert [r["status"] for r in rewritten] == ["stale"]
    assert rewritten[0]["problems"] == ["not a configuration of the current code: the table is stale"]


def test_register_comparison_reads_another_tritons_compile_check(tmp_path):
    """``--compiled``: rows of ``launch/gpu_compile.py --json`` (made by another triton) as the device's numbers: a
    spill there is local memory, a compile error fails the row, a register change is reported."""
    from dataclasses import asdict

    from pipeline.gpucheck import kernel_compile as kc
    from pipeline.gpucheck import registers

    table, text = _generated_table(tmp_path)
    rows = [r for r in registers.parse_table(text) if r["target"] == "sm_90"]
    cases = registers.match_cases(rows, kc.default_cases(targets=("sm_90",)))
    compiled = []
    for i, r in enumerate(rows):
        result = kc.Result(
            cases[i], registers=r["registers"], stack_bytes=r["stack_bytes"], shared_bytes=r["shared_bytes"]
        )
        if i == 0:
            result = kc.Result(cases[i], error="CompilationError: boom")
        if i == 1:
            result = kc.Result(cases[i], registers=r["registers"] - 2, shared_bytes=r["shared_bytes"])
        if i == 2:
            result = kc.Result(
                cases[i],
                registers=r["registers"],
                spill_store_bytes=8,
                spill_load_bytes=8,
                shared_bytes=r["shared_bytes"],
            )
        compiled.append({**asdict(result), "problems": result.problems})
    (tmp_path / "compiled.json").write_text(json.dumps(compiled))
    out = tmp_path / "registers.json"
    args = ["--table", str(table), "--out", str(out), "--compiled", str(tmp_path / "compiled.json")]
    assert registers.main(args) == 1  # the compile error
    report = json.loads(out.read_text())
    assert report["metadata_source"] == "compiled without a GPU (compiled.json)"
    assert (report["same"], report["differs"], report["spills"], report["failed"]) == (len(rows) - 3, 1, 1, 1)
    first, second, third = report["rows"][:3]
    assert first["problems"] == ["compile error: CompilationError: boom"]
    assert second["differs"] == [f"registers {rows[1]['registers']} -> {rows[1]['registers'] - 2}"]
    assert third["device_local_bytes"] == 8 and third["status"] == "spills"


@pytest.mark.parametrize(
    "table, message",
    [
        ("# nothing\n", "no '## Every configuration' section"),
        ("## Every configuration\n\n| kernel | target |\n|---|---|\n| fwd | sm_90 |\n", "has no column"),
    ],
)
def test_unreadable_register_table_is_one_line(tmp_path, capsys, table, message):
    from pipeline.gpucheck import registers

    (tmp_path / "t.md").write_text(table)
    args = ["--table", str(tmp_path / "t.md"), "--out", str(tmp_path / "o.json"), "--fake-metadata", "committed"]
    assert registers.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not (tmp_path / "o.json").exists()


def _report(mode: str = "cuda") -> dict:
    """A gpu-check.json of two stages with made-up numbers (not a measurement), for the publishing code."""
    machine = {"device": "NVIDIA H200" if mode == "cuda" else None, "torch": "9.9", "triton": "8.8", "cuda": "7.7"}
    return {
        "schema": 2,
        "mode": mode,
        "started": "2031-01-02T03:04:05+00:00",
        "budget_s": 450.0,
        "seconds": 123.4,
        "source": {"commit": "0123456789abcdef", "dirty": True, "from": "stamp gca-source.json"},
        "machine": machine,
        "stages": {
            "prep": {"status": "ok", "seconds": 11.0, "timeout_s": 60.0, "numbers": {"train_tokens": 1234567}},
            "train_gca_fsdp2": {"status": "failed", "seconds": 5.0, "timeout_s": 120.0, "log_tail": ["a", "boom|x"]},
        },
        "summary": {"stages_ok": ["prep"], "stages_not_ok": ["train_gca_fsdp2"]},
    }


def test_kernel_bench_fastest_baseline_in_summary_and_table():
    """The summary and the published table carry the kernel benchmark's ``fastest`` dense baseline and the fused
    GCA's ``time_vs_fastest`` per phase (made-up numbers, not a measurement); a benchmark JSON without them (an
    older run) keeps its cell as before."""
    from pipeline.gpucheck import publish
    from pipeline.gpucheck.stages import summary

    numbers = {
        "impls": {"triton_gca": {"fwd_ms": 0.3, "fwd_bwd_ms": 2.5}},
        "speedup_vs_naive": {"fwd_bwd": 5.85},
        "time_vs_flash": {"fwd_bwd": 1.06},
        "fastest": {"fwd": "sdpa_flash_flattened", "fwd_bwd": "flex_flattened", "bwd": "sdpa_cudnn_flattened"},
        "time_vs_fastest": {"fwd": 0.95, "fwd_bwd": 1.1, "bwd": 1.25},
    }
    stage = {"status": "ok", "numbers": numbers}
    got = summary({"kernel_bench": stage})
    assert got["kernel_fastest"] == numbers["fastest"] and got["kernel_time_vs_fastest"] == numbers["time_vs_fastest"]
    older = "fused fwd 0.300 ms, fwd+bwd 2.500 ms; 5.85x naive, 1.06x flash time (fwd+bwd)"
    assert publish.stage_numbers("kernel_bench", stage) == (
        f"{older}; time vs the fastest: fwd 0.95x (sdpa_flash_flattened), fwd+bwd 1.10x (flex_flattened), "
        "bwd 1.25x (sdpa_cudnn_flattened)"
    )
    without = {k: v for k, v in numbers.items() if k not in ("fastest", "time_vs_fastest")}
    assert publish.stage_numbers("kernel_bench", {"status": "ok", "numbers": without}) == older
    assert summary({})["kernel_time_vs_fastest"] is None


def test_publish_writes_the_json_and_the_docs_table(tmp_path):
    from pipeline.gpucheck import publish

    run = tmp_path / "gpu-check.json"
    run.write_text(json.dumps(_report()))
    docs = tmp_path / "gpu-check.md"
    docs.write_text(f"# page\nbefore\n{publish.RESULTS_BEGIN}\nold table\n{publish.RESULTS_END}\nafter\n")
    target, table = publish.publish(run, tmp_path / "results", docs)
    assert target == tmp_path / "results" / "2031-01-02-h200.json"
    assert json.loads(target.read_text()) == _report()
    lines = table.splitlines()
    assert "**1 of 2 stages ok in 123.4 s** of a 450 s budget" in lines[0]
    assert "torch 9.9, triton 8.8, CUDA 7.7" in lines[1] and "`0123456789` + uncommitted changes" in lines[1]
    assert lines[-2] == "| prep | ok | 11.0 | 60.0 | 1,234,567 train tokens |"
    assert lines[-1] == "| train_gca_fsdp2 | failed | 5.0 | 120.0 | boom\\|x |"
    page = docs.read_text()
    assert page.startswith("# page\nbefore\n") and page.endswith(f"{publish.RESULTS_END}\nafter\n")
    assert "old table" not in page and table in page
    publish.publish(run, tmp_path / "results", docs)
    assert docs.read_text() == page  # publishing again changes nothing

    run.write_text(json.dumps(_report("cpu-dry-run")))
    assert publish.publish(run, tmp_path / "results", docs)[0].name == "2031-01-02-cpu-dry-run.json"


@pytest.mark.parametrize(
    "content, docs_text, message",
    [
        ("{not json", None, "is not JSON"),
        ('{"mode": "cuda"}', None, "is not a gpu-check.json"),
        (None, "no markers here\n", "needs the lines"),
    ],
)
def test_publish_refuses_in_one_line_before_writing(tmp_path, content, docs_text, message):
    from pipeline.gpucheck import publish

    run = tmp_path / "gpu-check.json"
    run.write_text(content if content is not None else json.dumps(_report()))
    docs = tmp_path / "gpu-check.md"
    docs.write_text(docs_text or f"{publish.RESULTS_BEGIN}\n{publish.RESULTS_END}\n")
    before = docs.read_text()
    cmd = [sys.executable, "launch/gpu_check.py", "--publish", str(run), "--docs", str(docs)]
    cmd += ["--results-dir", str(tmp_path / "results")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr
    assert docs.read_text() == before and not (tmp_path / "results").exists()

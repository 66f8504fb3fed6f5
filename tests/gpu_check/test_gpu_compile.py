"""The GPU compile check (pipeline/gpucheck/kernel_compile.py): occupancy arithmetic, log parsing, tool errors and
real sm_80/sm_90 compiles checked against ptxas and cuobjdump run here, independently of the harness.

The compiles run in a subprocess: this test session sets TRITON_INTERPRET=1 (tests/conftest.py), under which the
kernels are interpreter stand-ins that Triton cannot compile. The full sweep is ``make test-gpu-compile``.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.gpucheck import kernel_compile as kc

ROOT = Path(__file__).resolve().parents[2]


def _run_check(args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "pipeline.gpucheck.kernel_compile", "--jobs", "1", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _ptxas_v(ptx: Path, capability: int) -> str:
    """ptxas -v on a PTX file, run here: the reference the harness' numbers are compared with."""
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    out = ptx.with_suffix(".ref.cubin")
    proc = subprocess.run(
        [kc.cuda_tool("ptxas"), "-v", f"--gpu-name={arch}", str(ptx), "-o", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stderr


def test_programs_per_sm_by_hand():
    h100, a100 = kc.TARGETS["sm_90"], kc.TARGETS["sm_80"]
    # 254 regs round up to 256/thread = 8192 per warp: 2 warps per scheduler, 8 per SM, two 4-warp programs.
    assert kc.programs_per_sm(h100, 254, 4, 24576) == (2, "registers")
    # 168 regs -> 5376 per warp: 3 per scheduler (16128 <= 16384), 12 warps, three 4-warp programs; 169 -> 176
    # regs -> 5632 per warp: only 2 per scheduler.
    assert kc.programs_per_sm(h100, 168, 4, 0) == (3, "registers")
    assert kc.programs_per_sm(h100, 169, 4, 0) == (2, "registers")
    # 255 regs at 8 warps: 8 warps fit, one program (the CUDA occupancy calculator's A100 answer too).
    assert kc.programs_per_sm(a100, 255, 8, 0) == (1, "registers")
    # 100 KiB + 1 KiB reserved per program: 2 on H100 (228 KiB), 1 on A100 (164 KiB).
    assert kc.programs_per_sm(h100, 32, 4, 100 * 1024) == (2, "shared")
    assert kc.programs_per_sm(a100, 32, 4, 100 * 1024) == (1, "shared")
    # 16 warps per program: 64 warps per SM allow 4; tiny 1-warp programs stop at 32 blocks.
    assert kc.programs_per_sm(h100, 16, 16, 0) == (4, "warps")
    assert kc.programs_per_sm(h100, 16, 1, 0) == (32, "blocks")
    # More shared memory than an SM has: nothing fits.
    assert kc.programs_per_sm(a100, 32, 4, 200 * 1024)[0] == 0


def test_parse_tool_output():
    usage = (
        "\nResource usage:\n Common:\n  GLOBAL:11 CONSTANT[4]:8\n Function _gca_fwd_kernel:\n"
        "  REG:254 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    )
    assert kc.parse_resource_usage(usage, "_gca_fwd_kernel") == {"REG": 254, "STACK": 16, "SHARED": 1024, "LOCAL": 0}
    with pytest.raises(ValueError, match="no resource line for other"):
        kc.parse_resource_usage(usage, "other")
    log = (
        "ptxas info    : Compiling entry function '_gca_fwd_kernel' for 'sm_90a'\n"
        "    2648 bytes stack frame, 4256 bytes spill stores, 4152 bytes spill loads\n"
        "ptxas info    : Used 64 registers, used 1 barriers, 2648 bytes cumulative stack size\n"
    )
    assert kc.parse_ptxas_log(log) == {"stack": 2648, "spill_stores": 4256, "spill_loads": 4152, "registers": 64}
    with pytest.raises(ValueError, match="no ptxas -v resource lines"):
        kc.parse_ptxas_log("ptxas fatal")


@pytest.mark.parametrize("target", tuple(kc.TARGETS))
def test_cases_cover_every_launch_the_wrappers_build(target):
    """Every (kernel, tiles, one-tile path) a launch on ``target`` builds for a real shape is a compiled case: the
    tiles of that architecture (``block_sizes(capability=)``), the fused backward only where its one query tile
    holds all G*Q rows, and a one-tile build of dq and the fused backward for chunks of S <= BS slots."""
    from kernels.gca import triton_utils as tu

    arch = kc.TARGETS[target].capability
    cases = kc.default_cases(targets=(target,))
    covered = {
        (c.kernel, c.dtype, c.head_dim, c.BQ, c.BS, c.BD, c.num_warps, c.num_stages, c.maxnreg, c.one_tile)
        for c in cases
    }
    for kernel in kc.KERNELS:
        for dtype in kc.DTYPES:
            for D in (64, 128, 65):  # 65 pads to the same tiles as 128
                for GQ in (1, 3, 16, 17, 40, 64, 100, 1000, 4096):
                    if kernel == "bwd_fused" and not tu.fused_backward(
                        GQ, 64, D, getattr(torch, dtype), capability=arch
                    ):
                        continue
                    for S in (1, 15, 33, 64, 500, 2048):
                        b = tu.block_sizes(GQ, S, D, getattr(torch, dtype), kernel, capability=arch)
                        head_dim = 64 if b.BD == 64 else 128
                        one_tile = S <= b.BS if kernel in ("bwd_dq", "bwd_fused") else None
                        key = (kernel, dtype, head_dim, b.BQ, b.BS, b.BD, b.num_warps, b.num_stages, b.maxnreg)
                        assert (*key, one_tile) in covered, (*key, one_tile)
    # Both softmax variants of each forward configuration, one build of each backward one.
    forward = [c for c in cases if c.kernel in ("fwd", "decode")]
    assert {c.off_by_one for c in forward} == {False, True} and len(forward) % 2 == 0
    assert {c.off_by_one for c in cases if c.kernel.startswith("bwd")} == {None}
    # Every fused case is a launch the wrapper accepts (all rows in one tile), on the target's own tiles.
    fused = [c for c in cases if c.kernel == "bwd_fused"]
    assert fused and all(c.BQ >= c.GQ for c in fused)
    d64 = {(c.BS, c.num_stages) for c in fused if c.dtype == "bfloat16" and c.head_dim == 64}
    assert d64 == ({(32, 1)} if target == "sm_80" else {(64, 2)})


def test_missing_ptxas_is_a_clear_failure(tmp_path):
    proc = _run_check(["--kernels", "decode"], {"TRITON_PTXAS_PATH": str(tmp_path / "ptxas")})
    assert proc.returncode == 2
    assert "ptxas not found or not executable" in proc.stderr and "TRITON_PTXAS_PATH" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_small_config_compiles_and_matches_ptxas(tmp_path):
    """One decode tile for sm_80 and sm_90: no spill, and the harness' registers equal a separate ptxas -v run."""
    out = tmp_path / "r.json"
    args = ["--dtypes", "float16", "--head-dims", "64", "--kernels", "decode", "--tiles", "16,16,64,4"]
    proc = _run_check([*args, "--json", str(out), "--dump-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert {(r["case"]["target"], r["case"]["off_by_one"]) for r in rows} == {
        (t, obo) for t in ("sm_90", "sm_80") for obo in (False, True)
    }
    for row in rows:
        case = kc.Case(**row["case"])
        log = _ptxas_v(tmp_path / f"{kc.case_id(case)}.ptx", kc.TARGETS[case.target].capability)
        assert row["registers"] == row["ptxas_registers"] == int(re.search(r"Used (\d+) registers", log)[1])
        assert "0 bytes spill stores, 0 bytes spill loads" in log
        assert row["spill_store_bytes"] == row["spill_load_bytes"] == 0 and not row["problems"]
        assert 0 < row["programs_per_sm"] <= 32


@pytest.mark.gpucompile
@pytest.mark.slow
def test_a_spilling_config_fails_the_check(tmp_path):
    """fp32, D=128, 64x64 tiles on 4 warps (the old fp32 tiles with half the warps) spills even with all 255
    registers; the check must say so and exit 1, and the SASS must hold local stores (STL), read here."""
    out = tmp_path / "r.json"
    args = ["--targets", "sm_90", "--dtypes", "float32", "--head-dims", "128", "--kernels", "fwd"]
    proc = _run_check([*args, "--tiles", "64,64,128,4", "--json", str(out), "--dump-dir", str(tmp_path)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["spill_store_bytes"] > 0 for r in rows)
    assert "FAIL fwd-obo-sm_90-float32-d128-64x64x128-w4-r255: spills" in proc.stderr
    cubin = tmp_path / f"{kc.case_id(kc.Case(**rows[0]['case']))}.cubin"
    sass = subprocess.run([kc.cuda_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    assert re.search(r"\bSTL(\.\w+)*\s", sass)


@pytest.mark.gpucompile
@pytest.mark.slow
def test_the_committed_table_describes_todays_kernels():
    """docs/results/gpu-compile.md against the code: the harness compiles every kernel triton_utils chooses tiles
    for, and every row of the table is a configuration the code produces today, so the GPU check's register
    comparison (``kernel_registers``) compares the kernels that run. Fails after a tile or kernel change until
    ``make test-gpu-compile`` regenerates the table."""
    from kernels.gca import triton_utils as tu
    from pipeline.gpucheck import registers

    chosen = {kernel for kernel, _ in tu.HALF_TILES}  # every kernel block_sizes picks tiles for
    assert chosen <= set(kc.KERNELS), f"kernel_compile.KERNELS lacks {sorted(chosen - set(kc.KERNELS))}"
    rows = registers.parse_table((ROOT / "docs/results/gpu-compile.md").read_text())
    for target in kc.TARGETS:
        mine = [r for r in rows if r["target"] == target]
        cases = kc.default_cases(targets=(target,))
        matched = registers.match_cases(mine, cases)
        stale = [f"{r['kernel']} {r['dtype']} D{r['head_dim']} {r['tiles']}" for i, r in enumerate(mine)]
        stale = [name for i, name in enumerate(stale) if i not in matched]
        assert not stale and len(mine) == len(cases), f"{target}: stale rows {stale}; {len(cases)} configurations today"

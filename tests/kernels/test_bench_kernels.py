"""``pipeline/bench/kernels.py`` on the CPU: the interpreter's work counts against closed forms, the dry run's
ratios against its own rows, the tile sweep's plumbing, and bad input refused in one line."""

from __future__ import annotations

import pytest
import torch

from pipeline.bench import kernels as kb

pytestmark = pytest.mark.kernels

FP32 = 4  # bytes


def _tile_macs(n: int = 16) -> int:
    return n * n * n  # one 16 x 16 x 16 tl.dot: fp32 tiles are 16 x 16 and D = 16 pads to nothing


def test_work_counts_fused_backward_closed_form():
    """G*Q = 16 rows, R = 3 chunks of S = 16 slots, fp32 16-wide tiles: the fused backward runs one program per
    kv head; per chunk it loads K and V once and makes 5 products (P, dP, dv, dk, dq); the forward makes 2."""
    B, H, Q, S, R, D = 2, 1, 16, 16, 3, 16
    work = kb.count_work((B, H, H, Q, S, R, D), torch.float32)
    assert work["backward_layout"] == "fused"
    fwd, bwd = work["per_batch_kv_head"]["fwd"], work["per_batch_kv_head"]["bwd"]
    tile = Q * D * FP32  # one [16, 16] fp32 tile
    assert fwd["dots"] == 2 * R and fwd["dot_macs"] == 2 * R * _tile_macs()
    assert fwd["bytes_loaded"] == tile + R * (2 * tile + FP32)  # q, then K, V and the weight of each chunk
    assert fwd["bytes_stored"] == tile + R * Q * FP32  # o and the per-chunk log-sum-exp
    assert bwd["dots"] == 5 * R and bwd["dot_macs"] == 5 * R * _tile_macs()
    assert bwd["bytes_loaded"] == 2 * tile + R * (2 * tile + Q * FP32 + FP32)  # q, dO; K, V, lse, w per chunk
    assert bwd["bytes_stored"] == tile + R * (2 * tile + FP32)  # dq; dk, dv and the delta sum per chunk


def test_work_counts_split_backward_closed_form():
    """G*Q = 2 * 16 rows: two query tiles, so dq (3 products per query tile and chunk, delta from the same tile)
    and dk/dv (4 products per query tile and chunk) are separate kernels, and K, V are read by both."""
    R = 2
    work = kb.count_work((1, 2, 1, 16, 16, R, 16), torch.float32)
    assert work["backward_layout"] == "split"
    bwd = work["per_batch_kv_head"]["bwd"]
    assert bwd["dots"] == 2 * R * (3 + 4) and bwd["dot_macs"] == bwd["dots"] * _tile_macs()


def test_dry_run_ratios_and_skips():
    rows, skipped = kb.measure(kb.TINY_SHAPE, "cpu", torch.float32)
    dense = {n: r for n, r in rows.items() if n not in kb.GCA_IMPLS}
    assert set(rows) == {"triton_gca", "naive_gca", "sdpa_flash_flattened"}
    assert set(skipped) == {
        "sdpa_cudnn_flattened",
        "sdpa_efficient_flattened",
        "flex_flattened",
        "flash_attn_flattened",
    }
    assert all(skipped.values())  # every skip says why
    flops = kb.fwd_flops(kb.TINY_SHAPE)
    for phase in kb.PHASES:
        fastest = min(r[f"{phase}_ms"] for r in dense.values())
        for row in rows.values():
            assert row[f"{phase}_vs_fastest"] == pytest.approx(row[f"{phase}_ms"] / fastest)
            assert row[f"{phase}_tflops"] == pytest.approx(flops * kb.FLOPS_FACTOR[phase] / row[f"{phase}_ms"] * 1e-9)


def test_tiny_tile_sweep_times_every_kernel():
    sweep = kb.sweep_tiles(kb.TINY_SWEEP_SHAPE, "cpu", torch.float16, kb.Timer(False, reps=1), limit=2)
    assert set(sweep["kernels"]) == set(kb.tu.KERNELS)
    for result in sweep["kernels"].values():
        assert len(result["timings"]) == 2 and all("ms" in t for t in result["timings"])
        assert result["best"]["ms"] == min(t["ms"] for t in result["timings"])
    best = {name: r["best"]["ms"] for name, r in sweep["kernels"].items()}
    layouts = sweep["backward_ms"]
    assert layouts["split"] == best["bwd_dq"] + best["bwd_dkdv"] and layouts["fused"] == best["bwd_fused"]
    assert layouts["faster"] == min(("split", "fused"), key=layouts.__getitem__)


@pytest.mark.parametrize("shape", ["1,2,3", "1,3,2,4,4,1,16", "a,b,c,d,e,f,g", "0,1,1,1,1,1,16"])
def test_bad_shape_is_one_line_exit_2(shape, capsys):
    assert kb.main(["--shape", shape]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"--shape {shape}:")

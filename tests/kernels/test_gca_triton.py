"""Fused Triton GCA vs ``naive_gca`` on the CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).

Shapes are tiny (the interpreter is ~300x slower than torch) but awkward: Q=1, Q and S not multiples of the tile,
S in {15, 16, 17}, R in {1, 2, 3}, G in {1, 2, 3, 4}, D in {16, 24, 32}, and forced 16x16 tiles so several query
and slot tiles (with ragged last tiles) run per launch. Every dtype runs both backward layouts (fused: one query
tile per kv head; split: dq then dk/dv), each with one-tile and several-tile chunks. Every kernel-allocated buffer
starts as NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gca_checks import FLOOR, RATIO, assert_gca_close, gca_in_dtype, make_inputs

from kernels.gca import gca_attention, naive_gca
from kernels.gca import triton_utils as tu
from kernels.gca.triton_gca import triton_gca, triton_gca_decode

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("nan_kernel_outputs")]

# (B, HQ, H, Q, S, R, D, softmax_off_by_one, small_tiles)
CASES = [
    (1, 1, 1, 1, 16, 1, 16, False, False),
    (1, 2, 2, 1, 15, 3, 16, True, False),
    (2, 2, 2, 17, 15, 3, 16, True, False),
    (1, 4, 1, 17, 17, 2, 32, False, False),
    (1, 4, 1, 5, 16, 3, 32, True, False),
    (2, 3, 1, 7, 17, 1, 24, False, False),
    # The official kernel's landmark-row bug: Q=65 with 16-row tiles leaves one row in the last tile.
    (1, 1, 1, 65, 64, 2, 16, False, True),
    (1, 2, 1, 20, 40, 2, 16, True, True),
    # One query tile holds all G*Q = 12 rows (fused backward), the 40 slots take three 16-slot tiles.
    (2, 3, 1, 4, 40, 2, 16, True, True),
    # DRT's per-head shape at a small D: half precision runs the fused backward on full 64-row, 64-slot tiles.
    (1, 2, 2, 64, 63, 2, 16, False, False),
]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def case_id(case):
    B, HQ, H, Q, S, R, D, off, small = case
    return f"B{B}-HQ{HQ}-H{H}-Q{Q}-S{S}-R{R}-D{D}-off{int(off)}" + ("-tiles16" if small else "")


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(tu, "MAX_BLOCK_Q", 16)
    monkeypatch.setattr(tu, "MAX_BLOCK_S", 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_naive(case, dtype, request):
    B, HQ, H, Q, S, R, D, off, small = case
    if small:
        request.getfixturevalue("small_tiles")
    q, k, v, weights, do = make_inputs(B, HQ, H, Q, S, R, D, dtype)
    assert_gca_close(triton_gca, q, k, v, weights, do, softmax_off_by_one=off)


def _backward_layout(case, dtype, monkeypatch):
    """(fused, one slot tile per chunk) of the backward a case runs, with its tile overrides applied."""
    B, HQ, H, Q, S, R, D, off, small = case
    with monkeypatch.context() as m:
        if small:
            m.setattr(tu, "MAX_BLOCK_Q", 16)
            m.setattr(tu, "MAX_BLOCK_S", 16)
        GQ = HQ // H * Q
        fused = tu.fused_backward(GQ, S, D, dtype)
        blocks = tu.block_sizes(GQ, S, D, dtype, "bwd_fused" if fused else "bwd_dq")
    return fused, S <= blocks.BS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_cases_run_every_backward_layout(dtype, monkeypatch):
    """CASES reach the fused and the split backward, each with one-tile and several-tile chunks (fp32/fp64 and
    fp16/bf16 choose different tiles)."""
    layouts = {_backward_layout(case, dtype, monkeypatch) for case in CASES}
    assert layouts == {(True, True), (True, False), (False, True), (False, False)}


@pytest.mark.parametrize("off", [False, True], ids=["off0", "off1"])
def test_gradcheck_fp64(off):
    q, k, v, weights, _ = make_inputs(1, 2, 1, 3, 5, 2, 16, torch.float64)
    inputs = [t.requires_grad_(True) for t in (q, k, v, weights)]
    assert torch.autograd.gradcheck(
        lambda *x: triton_gca(*x, softmax_off_by_one=off), inputs, fast_mode=True, atol=1e-7, rtol=1e-5
    )


def test_off_by_one_changes_output():
    # Small logits: the virtual zero logit then takes a large share of every chunk's softmax.
    q, k, v, weights, _ = make_inputs(1, 2, 2, 3, 8, 2, 16, torch.float32)
    with_one = triton_gca(q, k, v, weights, softmax_off_by_one=True)
    without = triton_gca(q, k, v, weights, softmax_off_by_one=False)
    assert (with_one - without).abs().max() > 1e-2
    # The "+1" only ever shrinks a chunk's read: o_r(with) = o_r(without) * sum(e^z) / (1 + sum(e^z)).
    assert torch.allclose(with_one, naive_gca(q, k, v, weights, softmax_off_by_one=True), atol=1e-6)


@pytest.mark.parametrize("Q", [1, 2, 9])
def test_decode_matches_naive(Q):
    q, k, v, weights, _ = make_inputs(2, 4, 1, Q, 17, 3, 32, torch.float32)
    q.requires_grad_(True)
    o = triton_gca_decode(q, k, v, weights, softmax_off_by_one=True)
    assert not o.requires_grad
    assert torch.allclose(o, naive_gca(q, k, v, weights, softmax_off_by_one=True), atol=1e-6)
    with torch.no_grad():  # triton_gca without autograd takes the decode path: identical result
        assert torch.equal(triton_gca(q, k, v, weights, softmax_off_by_one=True), o)


def test_dispatch_triton_backend():
    q, k, v, weights, do = make_inputs(1, 2, 1, 5, 16, 2, 16, torch.float32)
    assert_gca_close(lambda *x, **kw: gca_attention(*x, **kw, backend="triton"), q, k, v, weights, do)


@pytest.mark.parametrize(
    "D, HQ, dtype, k_dtype, match",
    [
        (8, 2, torch.float32, None, r"head dim D=8 .*16 <= D <= 128"),
        (160, 2, torch.float32, None, r"head dim D=160 .*16 <= D <= 128"),
        (16, 2, torch.float32, torch.float16, r"k\.dtype=torch\.float16 must equal q\.dtype=torch\.float32"),
        (16, 2, torch.int32, None, r"q\.dtype=torch\.int32 is not supported"),
        (16, 3, torch.float32, None, r"HQ=3 must be a multiple of key/value heads H=2"),
    ],
    ids=["D8", "D160", "mixed-dtype", "int-dtype", "HQ-not-multiple"],
)
def test_unsupported_inputs_raise(D, HQ, dtype, k_dtype, match):
    q, k, v, weights, _ = make_inputs(1, HQ, 2 if HQ == 3 else 1, 2, 4, 1, D, dtype)
    with pytest.raises(ValueError, match=match):
        triton_gca(q, k.to(k_dtype or dtype), v, weights)


def test_cpu_without_interpreter_raises_with_fix(monkeypatch):
    monkeypatch.setattr(tu, "INTERPRET", False)
    q, k, v, weights, _ = make_inputs(1, 1, 1, 2, 4, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=r"q\.device=cpu.*backend='naive'.*TRITON_INTERPRET=1"):
        gca_attention(q, k, v, weights, backend="triton")


def test_cpu_without_interpreter_raises_in_fresh_process():
    """The real environment path: a process that never set TRITON_INTERPRET."""
    code = (
        "import torch; from kernels.gca import gca_attention\n"
        "q = torch.randn(1, 1, 2, 16); k = torch.randn(1, 1, 1, 4, 16)\n"
        "gca_attention(q, k, k, torch.ones(1, 1), backend='triton')\n"
    )
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("kernel", tu.KERNELS)
def test_every_sweep_candidate_tile_matches_naive(kernel, monkeypatch):
    """Each (query, slot) tile pair ``tile_candidates`` offers the GPU sweep, in the kernel it is for, gives the
    naive result (warps and stages do not exist on the interpreter): a sweep winner can be committed as is."""
    q, k, v, weights, do = make_inputs(1, 2, 2, 64, 40, 2, 16, torch.float16)  # G*Q = 64, S = 40
    default = tu.block_sizes
    pairs = {(b.BQ, b.BS): b for b in tu.tile_candidates(64, 16, kernel)}
    monkeypatch.setattr(tu, "fused_backward", lambda *a, **kw: kernel == "bwd_fused")
    for blocks in pairs.values():
        monkeypatch.setattr(tu, "block_sizes", lambda *a, b=blocks, **kw: b if a[-1] == kernel else default(*a, **kw))
        if kernel == "decode":  # forward only: the ratio rule of assert_gca_close on the output
            truth = naive_gca(q.double(), k.double(), v.double(), weights.double(), softmax_off_by_one=True)
            base = (gca_in_dtype(q, k, v, weights, softmax_off_by_one=True).double() - truth).abs().max()
            err = (triton_gca_decode(q, k, v, weights, softmax_off_by_one=True).double() - truth).abs().max()
            assert err <= RATIO * base + FLOOR[q.dtype] * max(1.0, truth.abs().max().item()), blocks
        else:
            assert_gca_close(triton_gca, q, k, v, weights, do, softmax_off_by_one=True)


def test_tiles_follow_the_compute_capability(monkeypatch):
    """The tiles are a function of the compute capability: below sm_90 the fused D=64 backward swaps 64x64 slots,
    8 warps, 2 stages (which ptxas spills on sm_80) for 64x32, 8 warps, 1 stage and stays fused at DRT's G*Q = 64;
    sm_90 and newer, and no GPU (None: the interpreter), keep HALF_TILES, and no other kernel changes."""
    bf16 = torch.bfloat16
    for arch in (None, 90, 100):
        assert tu.block_sizes(64, 63, 64, bf16, "bwd_fused", capability=arch) == tu.Blocks(64, 64, 64, 8, 2)
    for arch in (80, 86, 89):
        assert tu.block_sizes(64, 63, 64, bf16, "bwd_fused", capability=arch) == tu.Blocks(64, 32, 64, 8, 1)
        assert tu.fused_backward(64, 63, 64, bf16, capability=arch)
    for kernel in tu.KERNELS:
        for D in (16, 64, 128):
            for dtype in (torch.float16, bf16, torch.float32):
                a100 = tu.block_sizes(64, 63, D, dtype, kernel, capability=80)
                h100 = tu.block_sizes(64, 63, D, dtype, kernel, capability=90)
                assert (a100 == h100) == (kernel != "bwd_fused" or D > 64 or dtype == torch.float32), (kernel, D)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert tu.capability(torch.device("cuda", 0)) == 80 and tu.capability(torch.device("cpu")) is None


def test_sm80_fused_backward_matches_naive(monkeypatch):
    """DRT's per-head shape (G*Q = 64, S = 63) as an sm_80 device runs it: the launch the wrapper builds takes the
    sm_80 tiles (two 32-slot tiles per chunk, so delta's first pass runs) and its gradients match fp64 naive_gca."""
    from kernels.gca import triton_bwd

    monkeypatch.setattr(tu, "capability", lambda device: 80)
    launched = []
    fused_launch = triton_bwd.bwd_fused_launch

    def spy(*args, **kwargs):
        launch = fused_launch(*args, **kwargs)
        launched.append(launch.kwargs)
        return launch

    monkeypatch.setattr(triton_bwd, "bwd_fused_launch", spy)
    q, k, v, weights, do = make_inputs(1, 2, 2, 64, 63, 2, 16, torch.bfloat16)
    assert_gca_close(triton_gca, q, k, v, weights, do)
    assert launched and all(
        (kw["BQ"], kw["BS"], kw["num_stages"], kw["ONE_TILE"]) == (64, 32, 1, False) for kw in launched
    )

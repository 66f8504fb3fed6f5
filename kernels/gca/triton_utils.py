"""Shared pieces of the Triton GCA kernels: input validation, tile sizes, output allocation and the dot helper.

Kernel layout (glossary in ``kernels/__init__.py``): ``q [B, HQ, Q, D]`` is contiguous, so the ``G = HQ // H``
query heads that share one key/value head are ``G * Q`` consecutive rows. Every kernel therefore sees queries,
outputs and their gradients as ``[B * H, G * Q, D]`` row blocks (written ``GQ`` below), and memories as
``[B * H, R, S, D]``. Per-(row, chunk) statistics (``lse``, ``delta``) are ``[B, H, R, GQ]`` fp32 (fp64 for fp64
inputs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.gca.limits import MAX_HEAD_DIM, MIN_HEAD_DIM
from kernels.gca.naive import check_gca_inputs

# triton.jit decides at decoration time whether kernels run on the CPU interpreter, so the flag is read once, at
# import, like Triton itself does.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_ONLY_DTYPES = (torch.float64,)  # fp64 tl.dot/exp2 are only exercised on the CPU interpreter

# Upper bounds of the query-row and memory-slot tiles. Tests lower them to force several tiles on tiny,
# interpreter-friendly shapes. The per-kernel choices below stay under them.
MAX_BLOCK_Q = 64
MAX_BLOCK_S = 64

# (query rows, memory slots, warps, pipeline stages) per (kernel, padded head dim) for fp16/bf16; the query-row
# tile is the largest allowed, smaller when G * Q is. Chosen from sm_90/sm_80 compiles (registers, spills; the
# table is docs/results/gpu-compile.md, make test-gpu-compile), never timed. The forward, dq and dk/dv take the
# largest tiles that compile without a spill on both targets, preferring >= 3 programs per SM, with 32 slots
# (64-slot forward and dq tiles spill 12-20 bytes on one target or the other). The fused backward needs all G * Q
# rows of a kv head in one tile (64) and takes 64 slots at D = 64, so a DRT chunk (S = 63 or 64) is one tile: its
# delta needs no pass of its own, and with no slot loop the chunk loop is innermost, where Triton's pipeliner
# prefetches the next chunk. It needs 8 warps there (4 spill on sm_90) and spills on sm_80, which takes
# ``SM80_TILES`` instead; at D = 128 it takes 16 slots and 1 stage (with 2, the 32-row tile of G * Q <= 32 spills
# 8 B on sm_90 when a chunk has several slot tiles; with 1 no variant spills on either target, the 64-row one with
# a slot loop at 255 registers on sm_90).
# ``pipeline/bench/kernels.py --sweep-tiles`` times ``tile_candidates`` on a GPU, to replace these by measured
# winners.
HALF_TILES = {
    ("fwd", 64): (64, 32, 4, 2),
    ("decode", 64): (64, 32, 4, 2),
    ("bwd_dq", 64): (32, 32, 4, 2),
    ("bwd_dkdv", 64): (64, 32, 4, 2),
    ("bwd_fused", 64): (64, 64, 8, 2),
    ("fwd", 128): (32, 32, 8, 2),
    ("decode", 128): (32, 32, 8, 2),
    ("bwd_dq", 128): (16, 32, 8, 2),
    ("bwd_dkdv", 128): (64, 32, 8, 2),
    ("bwd_fused", 128): (64, 16, 8, 1),
}
# Where sm_80 (A100; every GPU below sm_90 takes these) needs other tiles than HALF_TILES. ptxas for sm_80 spills
# the fused D = 64 backward at 64x64 slots (112 B per thread with 8 warps and 2 stages, 8 B with 1 stage) and at
# 64x32 slots with 2 stages (104 B at 8 warps, 80 B at 4); 64x32 slots, 8 warps, 1 stage compiles without a spill
# in both chunk variants (246 registers with a slot loop, 189 for one-tile chunks). A DRT chunk (S = 63/64) is then
# two slot tiles with delta's first pass, still one launch and one read of dO, Q per kv head (untimed; the split
# backward is the other spill-free choice).
SM80_TILES = {("bwd_fused", 64): (64, 32, 8, 1)}
KERNELS = ("fwd", "decode", "bwd_dq", "bwd_dkdv", "bwd_fused")
# fp32 (and interpreter-only fp64) dots are exact IEEE products on the FMA units, not tensor cores: every live
# tile costs twice the registers, so the tiles are the smallest tl.dot allows. ptxas, left to itself, trades a few
# spilled bytes for occupancy on these kernels; FULL_REGISTERS lets it use all 255 instead (no spill in the table).
WIDE_TILE = 16
FULL_REGISTERS = 255


@dataclass(frozen=True)
class Blocks:
    """Constexpr tile sizes of one launch: query rows ``BQ``, memory slots ``BS``, padded head dim ``BD``."""

    BQ: int
    BS: int
    BD: int
    num_warps: int
    num_stages: int = 2
    maxnreg: int | None = None  # registers per thread ptxas may use; None leaves the choice to ptxas

    def meta(self) -> dict[str, int | None]:
        """The launch keywords these tiles set (constexprs and compile options)."""
        return dict(
            BQ=self.BQ,
            BS=self.BS,
            BD=self.BD,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            maxnreg=self.maxnreg,
        )


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the wrappers build it. ``run`` launches it; ``pipeline/gpucheck/kernel_compile.py``
    compiles the very same arguments ahead of time for a GPU target, without a device."""

    kernel: Any  # a triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def capability(device: torch.device) -> int | None:
    """The compute capability of ``device`` as ``10 * major + minor`` (90 for H100/H200); None off CUDA (the
    interpreter), which takes the sm_90 tiles."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def half_tiles(capability: int | None) -> dict[tuple[str, int], tuple[int, int, int, int]]:
    """The fp16/bf16 tile table of an architecture: ``HALF_TILES``, with ``SM80_TILES`` below sm_90."""
    return {**HALF_TILES, **SM80_TILES} if capability is not None and capability < 90 else HALF_TILES


def block_sizes(GQ: int, S: int, D: int, dtype: torch.dtype, kernel: str, *, capability: int | None = None) -> Blocks:
    """Tile sizes of ``kernel`` (``fwd``, ``decode``, ``bwd_dq``, ``bwd_dkdv``, ``bwd_fused``) from the problem
    shape, dtype and the GPU's compute capability (``capability()``; None: the sm_90 tiles).

    No autotuning, so the interpreter needs no benchmarker. ``S`` does not matter: the slot tile is fixed per
    kernel."""
    BD = max(16, triton.next_power_of_2(D))
    if dtype in (torch.float32, torch.float64):
        tile = min(WIDE_TILE, MAX_BLOCK_Q, MAX_BLOCK_S)
        return Blocks(BQ=tile, BS=tile, BD=BD, num_warps=8 if BD > 64 else 4, maxnreg=FULL_REGISTERS)
    cap, BS, num_warps, num_stages = half_tiles(capability)[(kernel, 64 if BD <= 64 else 128)]
    BQ = min(cap, MAX_BLOCK_Q, max(16, triton.next_power_of_2(GQ)))
    return Blocks(BQ=BQ, BS=min(BS, MAX_BLOCK_S), BD=BD, num_warps=num_warps, num_stages=num_stages)


def fused_backward(GQ: int, S: int, D: int, dtype: torch.dtype, *, capability: int | None = None) -> bool:
    """Whether the backward takes the fused kernel: its query tile holds all ``GQ`` rows of a kv head."""
    return block_sizes(GQ, S, D, dtype, "bwd_fused", capability=capability).BQ >= GQ


def tile_candidates(GQ: int, D: int, kernel: str) -> list[Blocks]:
    """The fp16/bf16 tiles ``--sweep-tiles`` times for ``kernel``: 32 or 64 query rows (fewer when there are
    fewer; the fused backward: one tile of all ``GQ`` rows), 32 or 64 slots, 4 or 8 warps, 2 or 3 pipeline
    stages; the fused backward, heavy on registers, also 16 slots and 1 stage."""
    BD = max(16, triton.next_power_of_2(D))
    rows = min(MAX_BLOCK_Q, max(16, triton.next_power_of_2(GQ)))
    fused = kernel == "bwd_fused"
    query_tiles = [rows] if fused else sorted({min(bq, rows) for bq in (32, 64)})
    slot_tiles = [bs for bs in ((16, 32, 64) if fused else (32, 64)) if bs <= MAX_BLOCK_S]
    return [
        Blocks(BQ=bq, BS=bs, BD=BD, num_warps=warps, num_stages=stages)
        for bq in query_tiles
        for bs in slot_tiles
        for warps in (4, 8)
        for stages in ((1, 2) if fused else (2, 3))
    ]


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output. Every element is written by a kernel; tests swap in a NaN-filled allocator."""
    return torch.empty(shape, dtype=dtype, device=device)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in fp32, except fp64 inputs (gradcheck) stay fp64 throughout."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kernel_flags(dtype: torch.dtype) -> dict[str, object]:
    """Constexpr arguments shared by all GCA kernels for an input dtype."""
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    return {
        # The interpreter multiplies raw bf16 bit patterns in tl.dot (triton issue #11584), so upcast there.
        "UPCAST": INTERPRET and dtype == torch.bfloat16,
        # fp32 inputs must not silently drop to TF32 on GPU: the kernel is compared with an fp32 reference.
        "PREC": "ieee" if dtype in (torch.float32, torch.float64) else None,
        "ACC": acc,
    }


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the argument, its value and the supported range."""
    check_gca_inputs(q, k, v, weights)
    for name, t in (("k", k), ("v", v), ("weights", weights)):
        if t.device != q.device:
            raise ValueError(f"{name}.device={t.device} differs from q.device={q.device}; move all inputs together")
    if not q.is_cuda and not INTERPRET:
        raise ValueError(
            f"q.device={q.device}: the Triton GCA kernels need CUDA tensors. On CPU use backend='naive' "
            "(model.gca_backend=naive), or export TRITON_INTERPRET=1 before importing kernels.gca.triton_gca "
            "to run the kernels on the (slow) Triton interpreter"
        )
    dtypes = SUPPORTED_DTYPES + (INTERPRETER_ONLY_DTYPES if INTERPRET else ())
    if q.dtype not in dtypes:
        raise ValueError(
            f"q.dtype={q.dtype} is not supported; supported: {dtypes} (float64 only with TRITON_INTERPRET=1)"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={t.dtype} must equal q.dtype={q.dtype}")
    if not weights.is_floating_point():
        raise ValueError(f"weights.dtype={weights.dtype} must be a floating-point dtype")
    D = q.shape[-1]
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(
            f"head dim D={D} (q.shape[-1]) is not supported; supported: {MIN_HEAD_DIM} <= D <= {MAX_HEAD_DIM}"
        )


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """``a @ b`` accumulated in ``ACC``; ``UPCAST`` works around the interpreter's broken bf16 dot."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC, out_dtype=ACC)

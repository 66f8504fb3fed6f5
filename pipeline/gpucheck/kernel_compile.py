"""Every Triton kernel of the project compiled for Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU.

``make test-gpu-compile`` runs ``python launch/gpu_compile.py --out docs/results/gpu-compile.md``. For every GCA
kernel (training forward, decode forward, backward dq, backward dk/dv, fused backward), dtype, head dim, softmax
variant, every tile configuration ``kernels.gca.triton_utils.block_sizes`` returns for some shape and, for the
kernels with a one-tile path (``S <= BS``: no slot loop), both chunk variants, it builds the launch exactly as the
wrapper does (``fwd_launch`` / ``bwd_launches`` / ``bwd_fused_launch`` on small CPU tensors, with the target's
tiles: ``block_sizes(..., capability=)``), binds it the way ``JITFunction.run`` does (same signature, constexprs
and alignment/divisibility attributes), compiles it with ``triton.compile`` for a ``GPUTarget`` (PTX by LLVM, cubin
by the ``ptxas`` shipped in the Triton wheel; always a fresh compile, never Triton's cache, so the ``ptxas -v`` log
Triton asks for is there every time). Spill bytes come from that log, registers, stack and static shared memory
from ``cuobjdump --dump-resource-usage`` of the cubin, dynamic shared memory from Triton's metadata. A configuration
fails on a compile error, on any spill, or on more shared memory than the target lets one program use; the
occupancy column is the theoretical number of programs that fit on one SM (registers, shared memory, warps and the
32-block cap, as the CUDA occupancy calculator counts them). docs/gpu-check.md says what the numbers mean and what
they do not (no speed is measured).

Triton's binder (``create_function_from_signature``, ``JITFunction._pack_args``) is internal API of the pinned
triton==3.7.1; it is used on purpose, so the compiled kernels carry the same specialisation as a real launch.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import functools
import io
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_prep.safe_write import write_bytes, write_text

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128)
KERNELS = ("fwd", "decode", "bwd_dq", "bwd_dkdv", "bwd_fused")
# Kernels whose launch sets the ONE_TILE constexpr (S <= BS: a chunk is one slot tile, a different program with
# other register counts; DRT's S = 63/64 chunks in the fused kernel's 64-slot tiles take it).
ONE_TILE_KERNELS = ("bwd_dq", "bwd_fused")
# Representative shapes: B=1, H=2 key/value heads, G=1, R=4 chunks. GQ and S run over powers of two up to
# SHAPE_SPAN times the largest tile, so every tile block_sizes can return is reached; each configuration is
# compiled once, for the largest shape that selects it (integer arguments are then multiples of 16, as in training;
# the fused backward: the largest GQ its one query tile holds), and its one-tile variant at S = BS.
SHAPE_SPAN = 4
BATCH, KV_HEADS, CHUNKS = 1, 2, 4


@dataclass(frozen=True)
class Target:
    """What limits occupancy on one GPU architecture (CUDA programming guide, compute capability tables)."""

    name: str
    capability: int
    shared_per_sm: int  # bytes, largest carveout
    shared_per_block: int  # bytes, the opt-in maximum one program may use (Triton opts in above 48 KiB)
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    reserved_shared_per_block: int = 1024  # the driver keeps 1 KiB of each block's shared memory
    reg_alloc_unit: int = 256  # registers are given to a warp in units of 256
    sub_partitions: int = 4  # each SM's register file is split between 4 schedulers; a warp lives on one
    shared_alloc_unit: int = 128


TARGETS = {
    "sm_90": Target("sm_90", 90, shared_per_sm=233472, shared_per_block=232448),  # H100/H200: 228 / 227 KiB
    "sm_80": Target("sm_80", 80, shared_per_sm=167936, shared_per_block=166912),  # A100: 164 / 163 KiB
}


class ToolMissing(RuntimeError):
    """ptxas or cuobjdump cannot be found or run: the check cannot say anything, so it must not pass."""


@functools.cache
def cuda_tool(name: str) -> str:
    """Path of a CUDA binary shipped with the Triton wheel (``TRITON_<NAME>_PATH`` overrides it, as in Triton)."""
    import triton

    override = os.environ.get(f"TRITON_{name.upper()}_PATH")
    path = override or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    source = f"TRITON_{name.upper()}_PATH" if override else "the triton wheel"
    if not os.access(path, os.X_OK):
        raise ToolMissing(
            f"{name} not found or not executable at {path} (from {source}); the GPU compile check needs the "
            f"ptxas and cuobjdump that ship with triton==3.7.1 (reinstall it: make install), or set "
            f"TRITON_{name.upper()}_PATH to a CUDA 12.8+ {name}"
        )
    probe = subprocess.run([path, "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ToolMissing(f"{path} --version failed (exit {probe.returncode}): {probe.stderr.strip()[:200]}")
    return path


@dataclass(frozen=True)
class Case:
    """One kernel configuration to compile: which kernel, for which target, dtype, shape and tiles."""

    kernel: str
    target: str
    dtype: str
    head_dim: int
    off_by_one: bool | None  # None: the kernel has no such switch (the backward folds it into the saved lse)
    GQ: int
    S: int
    BQ: int
    BS: int
    BD: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None

    @property
    def tiles(self) -> str:
        return f"{self.BQ}x{self.BS}x{self.BD}"

    @property
    def one_tile(self) -> bool | None:
        """Whether the launch takes the one-tile path (``S <= BS``); None: the kernel has no such path."""
        return self.S <= self.BS if self.kernel in ONE_TILE_KERNELS else None


@dataclass(frozen=True)
class Result:
    case: Case
    registers: int = 0
    spill_store_bytes: int = 0  # per thread, from ptxas -v
    spill_load_bytes: int = 0
    ptxas_registers: int = 0  # "Used N registers" of the same ptxas -v log (equals ``registers``)
    stack_bytes: int = 0
    shared_bytes: int = 0  # dynamic (Triton's allocation) + static
    programs_per_sm: int = 0
    occupancy_limit: str = ""
    error: str = ""
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        if self.error:
            return [f"compile error: {self.error}"]
        out = []
        if self.spill_store_bytes or self.spill_load_bytes:
            out.append(f"spills ({self.spill_store_bytes} B stored, {self.spill_load_bytes} B loaded)")
        limit = TARGETS[self.case.target].shared_per_block
        if self.shared_bytes > limit:
            out.append(f"shared {self.shared_bytes} B > {limit} B")
        if self.programs_per_sm < 1:
            out.append("does not fit on one SM")
        return out


def programs_per_sm(target: Target, registers: int, num_warps: int, shared_bytes: int) -> tuple[int, str]:
    """Theoretical resident programs (thread blocks) per SM and the resource that limits them."""
    regs_per_warp = -(-registers * 32 // target.reg_alloc_unit) * target.reg_alloc_unit
    regs_per_partition = target.regs_per_sm // target.sub_partitions
    warps_by_regs = (regs_per_partition // max(regs_per_warp, 1)) * target.sub_partitions
    shared = shared_bytes + target.reserved_shared_per_block
    shared = -(-shared // target.shared_alloc_unit) * target.shared_alloc_unit
    limits = {
        "registers": warps_by_regs // num_warps,
        "shared": target.shared_per_sm // shared,
        "warps": target.max_warps_per_sm // num_warps,
        "blocks": target.max_blocks_per_sm,
    }
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


def parse_resource_usage(text: str, function: str) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of ``function`` from ``cuobjdump --dump-resource-usage``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"Function {function}:" and i + 1 < len(lines):
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            return {key: int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}
    raise ValueError(f"cuobjdump printed no resource line for {function}:\n{text[:500]}")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers and spill bytes from a ``ptxas -v`` log of one entry function."""
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    if not spills or not registers:
        raise ValueError(f"no ptxas -v resource lines in the compile log:\n{log[:500]}")
    return {
        "stack": int(spills[1]),
        "spill_stores": int(spills[2]),
        "spill_loads": int(spills[3]),
        "registers": int(registers[1]),
    }


def build_launch(case: Case, device: str = "cpu") -> Any:
    """The ``kernels.gca`` launch of ``case`` on small tensors (only their dtype, alignment and shape matter; CPU
    ones for a compile without a GPU)."""
    import torch

    from kernels.gca import triton_utils as tu
    from kernels.gca.triton_bwd import bwd_fused_launch, bwd_launches
    from kernels.gca.triton_fwd import fwd_launch

    dtype = getattr(torch, case.dtype)
    acc = tu.accumulator_dtype(dtype)
    q = torch.empty(BATCH, KV_HEADS, case.GQ, case.head_dim, dtype=dtype, device=device)
    k = torch.empty(BATCH, KV_HEADS, CHUNKS, case.S, case.head_dim, dtype=dtype, device=device)
    weights = torch.empty(BATCH, CHUNKS, dtype=torch.float32, device=device)
    lse = torch.empty(BATCH, KV_HEADS, CHUNKS, case.GQ, dtype=acc, device=device)
    blocks = tu.Blocks(case.BQ, case.BS, case.BD, case.num_warps, case.num_stages, case.maxnreg)
    scale = case.head_dim**-0.5
    if case.kernel in ("fwd", "decode"):
        saved = lse if case.kernel == "fwd" else None
        return fwd_launch(
            q, k, k, weights, q, saved, scale=scale, softmax_off_by_one=bool(case.off_by_one), blocks=blocks
        )
    if case.kernel == "bwd_fused":
        dw = torch.empty(BATCH, KV_HEADS, CHUNKS, dtype=acc, device=device)
        return bwd_fused_launch(q, q, k, k, weights, lse, q, k, k, dw, scale=scale, blocks=blocks)
    dq_launch, dkdv_launch = bwd_launches(q, q, k, k, weights, lse, lse, q, k, k, scale=scale, blocks=blocks)
    return dq_launch if case.kernel == "bwd_dq" else dkdv_launch


def default_cases(
    targets: tuple[str, ...] = tuple(TARGETS),
    dtypes: tuple[str, ...] = DTYPES,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    kernels: tuple[str, ...] = KERNELS,
) -> list[Case]:
    """Every (kernel, target, dtype, head dim, softmax variant, tile configuration) that real launches can hit."""
    import torch

    from kernels.gca import triton_utils as tu

    span = SHAPE_SPAN * max(tu.MAX_BLOCK_Q, tu.MAX_BLOCK_S)
    sizes = [2**i for i in range(span.bit_length())][::-1]  # largest first: the first shape seen represents
    cases = []
    for target in targets:
        for dtype in dtypes:
            for head_dim in head_dims:
                for kernel in kernels:
                    seen: set[tu.Blocks] = set()
                    for GQ in sizes:
                        for S in sizes:
                            blocks = tu.block_sizes(
                                GQ, S, head_dim, getattr(torch, dtype), kernel, capability=TARGETS[target].capability
                            )
                            if blocks in seen or (kernel == "bwd_fused" and blocks.BQ < GQ):
                                continue  # a fused launch needs all GQ rows in its query tile
                            seen.add(blocks)
                            variants: tuple[bool | None, ...] = (
                                (False, True) if kernel in ("fwd", "decode") else (None,)
                            )
                            chunks = (S, blocks.BS) if kernel in ONE_TILE_KERNELS else (S,)
                            for off_by_one in variants:
                                for slots in chunks:
                                    fields = asdict(blocks)
                                    cases.append(Case(kernel, target, dtype, head_dim, off_by_one, GQ, slots, **fields))
    return cases


def compile_case(case: Case, dump_dir: str | None = None) -> Result:
    """Compile one case for its target and read registers, spills and shared memory from ptxas and the cubin."""
    start = time.monotonic()
    try:
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        launch = build_launch(case)
        kernel = launch.kernel
        if not isinstance(kernel, JITFunction):
            raise RuntimeError("kernels were imported with TRITON_INTERPRET=1; run the compile check without it")
        target = GPUTarget("cuda", TARGETS[case.target].capability, 32)
        backend = make_backend(target)
        # What JITFunction.run adds to every launch's keywords before binding.
        kwargs = dict(launch.kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        log = io.StringIO()
        # Triton prints the ptxas -v log it always requests when asked to; always_compile bypasses its cache.
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True
            src = ASTSource(kernel, signature, constexprs, attrs)
            compiled = triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # a compile error is a result of this check, reported in the table
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return Result(case, error=f"{type(e).__name__}: {first[:300]}", seconds=time.monotonic() - start)
    ptxas = parse_ptxas_log(log.getvalue())
    name = compiled.metadata.name
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(dump_dir or tmp) / f"{case_id(case)}.cubin"
        write_bytes(cubin, compiled.asm["cubin"])
        write_text(cubin.with_suffix(".ptx"), compiled.asm["ptx"])
        usage = subprocess.run(
            [cuda_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        )
    res = parse_resource_usage(usage.stdout, name)
    shared = compiled.metadata.shared + res["SHARED"]
    programs, limiter = programs_per_sm(TARGETS[case.target], res["REG"], compiled.metadata.num_warps, shared)
    return Result(
        case,
        registers=res["REG"],
        spill_store_bytes=ptxas["spill_stores"],
        spill_load_bytes=ptxas["spill_loads"],
        ptxas_registers=ptxas["registers"],
        stack_bytes=res["STACK"],
        shared_bytes=shared,
        programs_per_sm=programs,
        occupancy_limit=limiter,
        seconds=time.monotonic() - start,
    )


def device_resources(case: Case) -> dict[str, int | None]:
    """Registers, local memory and shared memory of ``case`` as this machine's triton compiles it for its own GPU.

    ``warmup`` compiles exactly what a launch of these arguments would (without launching); loading the cubin makes
    the driver report ``n_regs`` and ``n_spills`` (local bytes per thread / 4), the compiled kernel's metadata holds
    the dynamic shared memory. The static shared memory (which the committed table adds in) is not in the metadata:
    it is read from the same cubin with the wheel's ``cuobjdump``, None where that tool is missing. Needs CUDA; the
    committed table's numbers come from ``compile_case`` on a machine without one."""
    launch = build_launch(case, device="cuda")
    compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    compiled._init_handles()
    static: int | None = None
    with contextlib.suppress(ToolMissing), tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        write_bytes(cubin, compiled.asm["cubin"])
        usage = subprocess.run(
            [cuda_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        )
        static = parse_resource_usage(usage.stdout, compiled.metadata.name)["SHARED"]
    return {
        "registers": int(compiled.n_regs),
        "local_bytes": 4 * int(compiled.n_spills),
        "dynamic_shared_bytes": int(compiled.metadata.shared),
        "static_shared_bytes": static,
    }


def case_id(case: Case) -> str:
    obo = {None: "", False: "-plain", True: "-obo"}[case.off_by_one]
    regs = f"-r{case.maxnreg}" if case.maxnreg else ""
    one = "-1tile" if case.one_tile else ""
    base = f"{case.kernel}{obo}{one}-{case.target}-{case.dtype}-d{case.head_dim}-{case.tiles}-w{case.num_warps}"
    return base + regs


def _worker_init() -> None:
    # The workers compile; they must see the real JITFunctions, not the interpreter's stand-ins.
    os.environ.pop("TRITON_INTERPRET", None)


def run_cases(cases: list[Case], jobs: int, dump_dir: str | None = None, progress=print) -> list[Result]:
    """Compile all cases on ``jobs`` processes, printing progress with an ETA; results in case order."""
    results: dict[int, Result] = {}
    start = time.monotonic()
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_worker_init) as pool:
        futures = {pool.submit(compile_case, case, dump_dir): i for i, case in enumerate(cases)}
        for done, future in enumerate(cf.as_completed(futures), 1):
            result = future.result()
            results[futures[future]] = result
            elapsed = time.monotonic() - start
            eta = elapsed / done * (len(cases) - done)
            status = "; ".join(result.problems) or f"{result.registers} regs, {result.programs_per_sm}/SM"
            progress(f"[{done}/{len(cases)}, {elapsed:.0f}s, eta {eta:.0f}s] {case_id(result.case)}: {status}")
    return [results[i] for i in range(len(cases))]


KERNEL_TITLES = {
    "fwd": "forward (training, saves lse)",
    "decode": "forward (decode, no lse)",
    "bwd_dq": "backward dq + delta",
    "bwd_dkdv": "backward dk/dv",
    "bwd_fused": "backward fused (dq, dk, dv, one program per kv head)",
}
ONE_TILE_CELLS = {None: "-", False: "no", True: "yes"}


def markdown(results: list[Result], wall_s: float, jobs: int) -> str:
    """The docs/results/gpu-compile.md table: one summary per kernel and target, then every configuration."""
    import triton

    failing = [r for r in results if r.problems]
    lines = [
        "# GPU compile check: registers, spills, shared memory, occupancy",
        "",
        "Generated by `make test-gpu-compile` (`pipeline/gpucheck/kernel_compile.py`; docs/gpu-check.md explains it).",
        f"triton {triton.__version__}, ptxas from the triton wheel; {len(results)} configurations compiled in "
        f"{wall_s:.0f} s on {jobs} processes; {len(failing)} failing.",
        "Programs/SM is theoretical occupancy from registers, shared memory and warps, not a measurement.",
        "The backward kernels have no off-by-one switch (it is folded into the saved lse): one build serves both.",
        "One tile: the chunk fits one slot tile (S <= BS, no slot loop; DRT's chunks in the fused backward), a "
        "separate build of dq and the fused backward; - for kernels without that path.",
        "",
        "## Summary",
        "",
        "| kernel | target | configs | registers (min-max) | spills | max shared bytes | programs/SM (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kernel in KERNELS:
        for target in TARGETS:
            rows = [r for r in results if r.case.kernel == kernel and r.case.target == target and not r.error]
            if not rows:
                continue
            regs = [r.registers for r in rows]
            progs = [r.programs_per_sm for r in rows]
            spills = sum(1 for r in rows if r.spill_store_bytes or r.spill_load_bytes)
            lines.append(
                f"| {KERNEL_TITLES[kernel]} | {target} | {len(rows)} | {min(regs)}-{max(regs)} | {spills} | "
                f"{max(r.shared_bytes for r in rows)} | {min(progs)}-{max(progs)} |"
            )
    if failing:
        lines += ["", "## Failing", ""]
        lines += [f"- `{case_id(r.case)}`: {'; '.join(r.problems)}" for r in failing]
    lines += [
        "",
        "## Every configuration",
        "",
        "Tiles are BQ x BS x BD (query rows, memory slots, padded head dim); max regs is the `maxnreg` launch option "
        "(- : ptxas chooses); spills are bytes per thread (ptxas -v); warps/SM = programs/SM x warps.",
        "",
        "| kernel | target | dtype | D | off-by-one | one tile | tiles | warps | stages | max regs | registers | "
        "spills (st/ld) | stack B | shared B | programs/SM | warps/SM | limited by | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        obo = {None: "either", False: "off", True: "on"}[c.off_by_one]
        config = f"| {c.kernel} | {c.target} | {c.dtype} | {c.head_dim} | {obo} | {ONE_TILE_CELLS[c.one_tile]} | "
        config += f"{c.tiles} | {c.num_warps} | "
        config += f"{c.num_stages} | {c.maxnreg or '-'} |"
        status = "; ".join(r.problems) or "ok"
        if r.error:
            lines.append(f"{config} | | | | | | | | {status} |")
            continue
        lines.append(
            f"{config} {r.registers} | {r.spill_store_bytes}/{r.spill_load_bytes} | {r.stack_bytes} | "
            f"{r.shared_bytes} | {r.programs_per_sm} | {r.programs_per_sm * c.num_warps} | {r.occupancy_limit} | "
            f"{status} |"
        )
    return "\n".join(lines) + "\n"


def _csv(kind, allowed):
    def parse(text: str) -> tuple:
        values = tuple(kind(v) for v in text.split(","))
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return values

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="gpu_compile")
    parser.add_argument("--out", type=Path, help="write the markdown table here (docs/results/gpu-compile.md)")
    parser.add_argument("--json", type=Path, help="also write every result as JSON")
    parser.add_argument("--targets", type=_csv(str, TARGETS), default=tuple(TARGETS))
    parser.add_argument("--dtypes", type=_csv(str, DTYPES), default=DTYPES)
    parser.add_argument("--head-dims", type=_csv(int, HEAD_DIMS), default=HEAD_DIMS)
    parser.add_argument("--kernels", type=_csv(str, KERNELS), default=KERNELS)
    parser.add_argument(
        "--tiles",
        help="compile only this tile configuration instead of block_sizes': BQ,BS,BD,WARPS[,STAGES[,MAXNREG]]",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: all cores)")
    parser.add_argument("--dump-dir", type=Path, help="keep each configuration's PTX and cubin here")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        cuda_tool("ptxas")
        cuda_tool("cuobjdump")
    except ToolMissing as e:
        print(f"gpu_compile: {e}", file=sys.stderr)
        return 2
    cases = default_cases(args.targets, args.dtypes, args.head_dims, args.kernels)
    if args.tiles:
        try:
            values = [int(v) for v in args.tiles.split(",")]
            tiles = dict(zip(("BQ", "BS", "BD", "num_warps", "num_stages", "maxnreg"), values))
            assert len(values) in (4, 5, 6)
        except (ValueError, AssertionError):
            parser.error(f"--tiles={args.tiles!r}: expected BQ,BS,BD,WARPS[,STAGES[,MAXNREG]] integers")
        cases = list(dict.fromkeys(_retile(c, tiles) for c in cases))
    if args.dump_dir:
        args.dump_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_compile: {len(cases)} configurations on {args.jobs} processes", flush=True)
    start = time.monotonic()
    results = run_cases(cases, args.jobs, str(args.dump_dir) if args.dump_dir else None, progress=_flush_print)
    wall = time.monotonic() - start
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.out, markdown(results, wall, args.jobs))
        print(f"gpu_compile: wrote {args.out}")
    if args.json:
        import json

        rows = [dict(asdict(r), problems=r.problems) for r in results]
        write_text(args.json, json.dumps(rows, indent=1))
    failing = [r for r in results if r.problems]
    for r in failing:
        print(f"FAIL {case_id(r.case)}: {'; '.join(r.problems)}", file=sys.stderr)
    print(f"gpu_compile: {len(results) - len(failing)}/{len(results)} ok in {wall:.0f} s")
    return 1 if failing else 0


def _retile(case: Case, tiles: dict[str, int]) -> Case:
    fields = asdict(case)
    # Keep what the case stands for: a fused launch holds all GQ rows in one tile, a one-tile case S <= BS.
    GQ = tiles["BQ"] if case.kernel == "bwd_fused" else SHAPE_SPAN * tiles["BQ"]
    S = tiles["BS"] if case.one_tile else SHAPE_SPAN * tiles["BS"]
    fields.update(tiles, GQ=GQ, S=S)
    return Case(**fields)


def _flush_print(message: str) -> None:
    print(message, flush=True)


if __name__ == "__main__":
    sys.exit(main())

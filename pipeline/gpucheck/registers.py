"""The committed register table against the device's own compiled kernels (the ``kernel_registers`` stage).

``docs/results/gpu-compile.md`` was made without a GPU, by the triton of this repository's lock (3.7.1); the GPU
image ships another triton (3.6), whose register allocation may differ. On the GPU,
``python -m pipeline.gpucheck.registers --table docs/results/gpu-compile.md --out registers.json`` compiles every
configuration of the table for the device's architecture with the image's triton (``kernel_compile.
device_resources``: the compiled kernel's ``n_regs``, ``n_spills`` and shared memory) and prints them beside the
committed numbers. Exit 1 when a configuration no longer compiles or needs more shared memory than one program may
have; other register counts (``differs``), spills the table has not (``spills``) and rows the code no longer
produces (``stale``: the table wants regenerating) are reported with ``table_holds: false``, not failed: they cost
speed or say the record is old, not that the machine is broken.

Without a GPU, ``--compiled FILE.json`` compares the table with ``launch/gpu_compile.py --json FILE.json`` made by
another triton on this machine (put that triton first on ``PYTHONPATH`` for both commands: the compile-time numbers
a GPU would load, though not read from a loaded kernel). ``--fake-metadata committed`` (the table's own numbers,
what the CPU dry run uses) or ``--fake-metadata FILE.json`` (``{config id: {"registers", "local_bytes",
"dynamic_shared_bytes", "static_shared_bytes"}}``) stands in for the device, so the parsing and the comparison run
on CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from data_prep.safe_write import write_text
from pipeline.gpucheck import kernel_compile as kc

ROW_FIELDS = (
    "kernel",
    "target",
    "dtype",
    "D",
    "off-by-one",
    "one tile",
    "tiles",
    "warps",
    "stages",
    "max regs",
    "registers",
    "spills (st/ld)",
    "stack B",
    "shared B",
)
OFF_BY_ONE = {"off": False, "on": True, "either": None}
ONE_TILE = {cell: value for value, cell in kc.ONE_TILE_CELLS.items()}


STATUSES = ("same", "differs", "spills", "stale", "failed")
"""Per configuration: as committed; other register counts or shared memory; local memory the table has not (a
spill: slower, still correct); a row the code no longer produces (the table needs ``make test-gpu-compile``, so it
cannot be compared); or broken (a compile error, shared memory over the limit, no reading)."""


class TableError(ValueError):
    """The committed table cannot be read; the message names the file and the line."""


def parse_table(text: str, path: str = "gpu-compile.md") -> list[dict]:
    """The rows of the table's "Every configuration" section, as dicts keyed by ``ROW_FIELDS``."""
    lines = text.splitlines()
    try:
        start = lines.index("## Every configuration")
    except ValueError:
        raise TableError(f"{path}: no '## Every configuration' section") from None
    header = next((i for i in range(start, len(lines)) if lines[i].startswith("| kernel |")), None)
    if header is None:
        raise TableError(f"{path}: no table under '## Every configuration'")
    names = [c.strip() for c in lines[header].strip("|").split("|")]
    missing = [f for f in ROW_FIELDS if f not in names]
    if missing:
        raise TableError(f"{path}:{header + 1}: the table has no column {missing}")
    rows = []
    for number, line in enumerate(lines[header + 2 :], header + 3):
        if not line.startswith("|"):
            break
        cells = dict(zip(names, (c.strip() for c in line.strip().strip("|").split("|"))))
        try:
            stores, loads = (int(v) for v in cells["spills (st/ld)"].split("/"))
            rows.append(
                {
                    **{f: cells[f] for f in ("kernel", "target", "dtype", "tiles")},
                    "head_dim": int(cells["D"]),
                    "off_by_one": OFF_BY_ONE[cells["off-by-one"]],
                    "one_tile": ONE_TILE[cells["one tile"]],
                    "num_warps": int(cells["warps"]),
                    "num_stages": int(cells["stages"]),
                    "maxnreg": None if cells["max regs"] == "-" else int(cells["max regs"]),
                    "registers": int(cells["registers"]),
                    "spill_bytes": stores + loads,
                    "stack_bytes": int(cells["stack B"]),
                    "shared_bytes": int(cells["shared B"]),
                }
            )
        except (KeyError, ValueError) as err:
            raise TableError(f"{path}:{number}: cannot read {line!r} ({type(err).__name__}: {err})") from None
    if not rows:
        raise TableError(f"{path}: the '## Every configuration' table has no rows")
    return rows


def _key(
    kernel: str,
    dtype: str,
    head_dim: int,
    off: bool | None,
    one_tile: bool | None,
    tiles: str,
    warps: int,
    stages: int,
    maxnreg: int | None,
) -> tuple:
    return (kernel, dtype, head_dim, off, one_tile, tiles, warps, stages, maxnreg)


def match_cases(rows: list[dict], cases: list[kc.Case]) -> dict[int, kc.Case]:
    """Row index -> the case of ``kernel_compile.default_cases`` it was compiled from (the shape is not in the
    table); a row without one was made for tiles ``block_sizes`` no longer returns (a stale table)."""
    by_key = {
        _key(c.kernel, c.dtype, c.head_dim, c.off_by_one, c.one_tile, c.tiles, c.num_warps, c.num_stages, c.maxnreg): (
            c
        )
        for c in cases
    }
    found = {}
    for i, r in enumerate(rows):
        case = by_key.get(
            _key(
                r["kernel"],
                r["dtype"],
                r["head_dim"],
                r["off_by_one"],
                r["one_tile"],
                r["tiles"],
                r["num_warps"],
                r["num_stages"],
                r["maxnreg"],
            )
        )
        if case is not None:
            found[i] = case
    return found


def committed_metadata(row: dict) -> dict:
    """The stand-in device of the dry run: a row's committed numbers in the device's terms (the table's shared
    column is the dynamic plus the static shared memory, its stack column the local memory)."""
    return {
        "registers": row["registers"],
        "local_bytes": row["stack_bytes"],
        "dynamic_shared_bytes": row["shared_bytes"],
        "static_shared_bytes": 0,
    }


def compiled_metadata(rows: list[dict]) -> dict[str, dict]:
    """``launch/gpu_compile.py --json`` rows in the device's terms, by config id: its stack frame is the local
    memory a loaded kernel reports (spills live there), its shared bytes already hold the static part."""
    out = {}
    for r in rows:
        case = kc.Case(**r["case"])
        if r.get("error"):
            out[kc.case_id(case)] = {"error": r["error"]}
            continue
        out[kc.case_id(case)] = {
            "registers": r["registers"],
            "local_bytes": max(r["stack_bytes"], r["spill_store_bytes"]),
            "dynamic_shared_bytes": r["shared_bytes"],
            "static_shared_bytes": 0,
        }
    return out


def compare(row: dict, measured: dict | None, target: kc.Target, matched: bool = True) -> dict:
    """One configuration: committed and device numbers side by side, and what differs or fails (``matched``:
    whether the current code still has this configuration)."""
    out = {
        "config": f"{row['kernel']} {row['dtype']} D{row['head_dim']} {row['tiles']} w{row['num_warps']}"
        + {None: "", False: " plain", True: " obo"}[row["off_by_one"]]
        + (" one-tile" if row["one_tile"] else "")
        + (f" r{row['maxnreg']}" if row["maxnreg"] else ""),
        "committed_registers": row["registers"],
        "committed_spill_bytes": row["spill_bytes"],
        "committed_shared_bytes": row["shared_bytes"],
    }
    if not matched:
        return {**out, "status": "stale", "problems": ["not a configuration of the current code: the table is stale"]}
    if measured is None:
        return {**out, "status": "failed", "problems": ["no metadata read for it"]}
    if "error" in measured:
        return {**out, "status": "failed", "problems": [f"compile error: {measured['error']}"]}
    static = measured.get("static_shared_bytes")
    shared = measured["dynamic_shared_bytes"] + (static or 0)
    out.update(
        device_registers=measured["registers"], device_local_bytes=measured["local_bytes"], device_shared_bytes=shared
    )
    problems = [f"shared {shared} B > {target.shared_per_block} B"] if shared > target.shared_per_block else []
    spills = []
    if measured["local_bytes"] > row["stack_bytes"]:
        spills.append(f"local memory {measured['local_bytes']} B per thread (spills; committed {row['stack_bytes']})")
    differs = []
    if measured["registers"] != row["registers"]:
        differs.append(f"registers {row['registers']} -> {measured['registers']}")
    if static is None:
        differs.append("static shared memory unknown (no cuobjdump): dynamic shared compared alone")
    elif shared != row["shared_bytes"]:
        differs.append(f"shared {row['shared_bytes']} -> {shared} B")
    status = "failed" if problems else "spills" if spills else "differs" if differs else "same"
    return {**out, "status": status, "problems": problems + spills, "differs": differs}


def _device_worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # the workers compile real kernels


def _device_one(case: kc.Case) -> dict:
    try:
        return kc.device_resources(case)
    except Exception as err:  # a compile error is this check's result for the configuration
        first = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        return {"error": f"{type(err).__name__}: {first[:300]}"}


def device_metadata(cases: dict[int, kc.Case], jobs: int) -> dict[int, dict]:
    """Compile every case on the GPU, ``jobs`` processes at a time (compiling is CPU work: LLVM and ptxas)."""
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=context, initializer=_device_worker_init) as pool:
        futures = {i: pool.submit(_device_one, case) for i, case in cases.items()}
        return {i: f.result() for i, f in futures.items()}


def committed_triton(text: str) -> str | None:
    """The triton version the table names in its header ("triton 3.7.1, ptxas from the triton wheel; ...")."""
    found = re.search(r"^triton (\S+), ", text, re.MULTILINE)
    return found[1] if found else None


def markdown(report: dict) -> str:
    """The comparison as a table, one row per configuration, for the stage's log."""
    results = report["rows"]
    lines = [
        f"Committed (triton {report.get('committed_triton') or '?'}, compiled without a GPU) vs triton "
        f"{report['triton']} ({report['metadata_source']} metadata), {report['target']}:",
        "",
        "| configuration | registers committed | registers here | shared B committed | shared B here | "
        "local B here | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        note = "; ".join(r.get("problems", []) + r.get("differs", []))
        lines.append(
            f"| {r['config']} | {r['committed_registers']} | {r.get('device_registers', '-')} | "
            f"{r['committed_shared_bytes']} | {r.get('device_shared_bytes', '-')} | "
            f"{r.get('device_local_bytes', '-')} | {r['status']}{': ' + note if note else ''} |"
        )
    return "\n".join(lines) + "\n"


def check(
    rows: list[dict],
    target: str,
    cases: list[kc.Case],
    measure: Callable[[dict[int, kc.Case]], dict[int, dict]],
    source: str,
    triton_version: str,
) -> dict:
    """Compare the table's rows for ``target`` with what ``measure`` reads for their cases."""
    mine = [r for r in rows if r["target"] == target]
    if not mine:
        raise TableError(f"the table has no {target} rows (it has {sorted({r['target'] for r in rows})})")
    matched = match_cases(mine, cases)
    measured = measure(matched)
    results = [compare(r, measured.get(i), kc.TARGETS[target], i in matched) for i, r in enumerate(mine)]
    count = {s: sum(1 for r in results if r["status"] == s) for s in STATUSES}
    regs = [r["device_registers"] - r["committed_registers"] for r in results if "device_registers" in r]
    return {
        "target": target,
        "triton": triton_version,
        "metadata_source": source,
        "configs": len(results),
        **count,
        "table_holds": count["same"] == len(results),
        "register_delta_min": min(regs, default=None),
        "register_delta_max": max(regs, default=None),
        "device_local_bytes_max": max((r.get("device_local_bytes", 0) for r in results), default=None),
        "rows": results,
    }


Measure = Callable[[dict[int, kc.Case]], dict[int, dict]]


def metadata_source(args: argparse.Namespace, mine: list[dict]) -> tuple[str, Measure]:
    """What stands for the device's numbers, and its label: the device itself, a compile of another triton
    (``--compiled``), or a stand-in (``--fake-metadata``); bad input raises ``TableError`` naming the file."""
    if args.compiled or args.fake_metadata not in (None, "committed"):
        path = Path(args.compiled or args.fake_metadata)
        try:
            loaded = json.loads(path.read_text())
            given = compiled_metadata(loaded) if args.compiled else dict(loaded)
        except (OSError, ValueError, KeyError, TypeError) as err:
            option = "--compiled" if args.compiled else "--fake-metadata"
            raise TableError(f"{option} {path}: {type(err).__name__}: {err}") from None
        label = f"compiled without a GPU ({path.name})" if args.compiled else f"stand-in ({path.name})"
        return label, lambda cases: {i: given[kc.case_id(c)] for i, c in cases.items() if kc.case_id(c) in given}
    if args.fake_metadata == "committed":
        return "committed", lambda cases: {i: committed_metadata(mine[i]) for i in cases}
    return "device", lambda cases: device_metadata(cases, args.jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="registers")
    parser.add_argument("--table", required=True, help="the committed table (docs/results/gpu-compile.md)")
    parser.add_argument("--out", required=True, help="write the comparison as JSON here")
    parser.add_argument("--target", choices=tuple(kc.TARGETS), help="default: the device's architecture, else sm_90")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--fake-metadata", help="'committed' or a JSON file of per-configuration numbers (no device)")
    source.add_argument("--compiled", help="a launch/gpu_compile.py --json file of this triton (no device)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    on_device = args.fake_metadata is None and args.compiled is None
    if on_device and not torch.cuda.is_available():
        print(
            "registers: error: no CUDA device; give --compiled or --fake-metadata to compare without one",
            file=sys.stderr,
        )
        return 2
    target = args.target
    if target is None and on_device:
        major, minor = torch.cuda.get_device_capability()
        target = f"sm_{major}{minor}"
    target = target or "sm_90"
    try:
        text = Path(args.table).read_text()
        rows = parse_table(text, args.table)
        if target not in kc.TARGETS:
            raise TableError(f"this device is {target}; the table and the compile check cover {sorted(kc.TARGETS)}")
        label, measure = metadata_source(args, [r for r in rows if r["target"] == target])
        report = check(rows, target, kc.default_cases(targets=(target,)), measure, label, triton.__version__)
    except OSError as err:
        print(f"registers: error: --table {args.table}: {err.strerror}", file=sys.stderr)
        return 2
    except TableError as err:
        print(f"registers: error: {err}", file=sys.stderr)
        return 2
    report["committed_triton"] = committed_triton(text)
    write_text(Path(args.out), json.dumps(report, indent=1) + "\n")
    print(markdown(report), flush=True)
    print(
        f"registers: {report['configs']} {target} configurations: {report['same']} same, {report['differs']} differ, "
        f"{report['spills']} spill, {report['stale']} stale, {report['failed']} failed "
        f"(metadata: {report['metadata_source']})"
    )
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Commit a GPU check's results: ``python3 launch/gpu_check.py --publish <gpu-check.json>``, run in the checkout
after the device run.

Copies the run's JSON to ``docs/results/gpu/<date>-<machine>.json`` (date of the run's start, machine from the
device's name: ``NVIDIA H200`` -> ``h200``; a CPU dry run is ``cpu-dry-run``) and writes its table into
``docs/gpu-check.md`` between the ``RESULTS_BEGIN`` / ``RESULTS_END`` lines (printed too). Nothing is
measured here: every number comes from the JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from data_prep.safe_write import write_text

RESULTS_BEGIN = "<!-- gpu-check results: written by launch/gpu_check.py --publish -->"
RESULTS_END = "<!-- end of gpu-check results -->"


class PublishError(ValueError):
    """The JSON or the docs file cannot be published; the message names the file and what is wrong."""


def load_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except OSError as err:
        raise PublishError(f"{path}: {err.strerror}") from None
    except ValueError as err:
        raise PublishError(f"{path} is not JSON ({err})") from None
    missing = [k for k in ("mode", "started", "machine", "stages", "summary") if k not in report]
    if not isinstance(report, dict) or missing:
        raise PublishError(f"{path} is not a gpu-check.json (no {missing})")
    return report


def machine_slug(report: dict) -> str:
    if report["mode"] != "cuda":
        return "cpu-dry-run"
    name = (report["machine"].get("device") or "unknown-gpu").lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown-gpu"


def result_name(report: dict) -> str:
    return f"{report['started'][:10]}-{machine_slug(report)}.json"


def _num(value, fmt: str = "{:,.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def stage_numbers(name: str, stage: dict) -> str:
    """The few numbers of a stage that go into the table; the JSON holds the rest."""
    if stage.get("status") != "ok":
        reason = stage.get("reason") or next(reversed(stage.get("log_tail") or [""]), "")
        return reason.replace("|", "\\|")[:200]
    n = stage.get("numbers", {})
    if name == "prep":
        return f"{_num(n.get('train_tokens'), '{:,}')} train tokens"
    if name == "kernel_bench":
        tri = n.get("impls", {}).get("triton_gca", {})
        cell = (
            f"fused fwd {_num(tri.get('fwd_ms'), '{:.3f}')} ms, fwd+bwd {_num(tri.get('fwd_bwd_ms'), '{:.3f}')} ms; "
            f"{_num(n.get('speedup_vs_naive', {}).get('fwd_bwd'), '{:.2f}')}x naive, "
            f"{_num(n.get('time_vs_flash', {}).get('fwd_bwd'), '{:.2f}')}x flash time (fwd+bwd)"
        )
        # Per phase, the fused GCA's time over the fastest dense baseline's, and which baseline that was.
        ratios, fastest = n.get("time_vs_fastest") or {}, n.get("fastest") or {}
        if ratios:
            cell += "; time vs the fastest: " + ", ".join(
                f"{phase.replace('_', '+')} {_num(ratio, '{:.2f}')}x ({fastest.get(phase) or '—'})"
                for phase, ratio in ratios.items()
            )
        return cell
    if name == "kernel_registers":
        return (
            f"{n.get('configs')} {n.get('target')} configurations, triton {n.get('triton')} vs committed "
            f"{n.get('committed_triton')}: {n.get('same')} same, {n.get('differs')} differ, {n.get('spills')} spill, "
            f"{n.get('stale')} stale, {n.get('failed')} failed; "
            f"register change {n.get('register_delta_min')}..{n.get('register_delta_max')} "
            f"({n.get('metadata_source')} metadata)"
        )
    if name == "gpu_tests":
        failed = n.get("failures", 0) + n.get("errors", 0)
        return f"{n.get('passed')} passed, {failed} failed, {n.get('skipped')} skipped"
    if name.startswith("train_"):
        return (
            f"{_num(n.get('tokens_per_step'), '{:,}')} tok/step; first step {_num(n.get('first_step_time_s'))} s, "
            f"then {_num(n.get('step_time_s'), '{:.3f}')} s/step, {_num(n.get('tokens_per_s'), '{:,.0f}')} tok/s, "
            f"MFU {_num(n.get('mfu_sparse_aware'), '{:.1%}')}, {_num(n.get('peak_mem_gb'))} GB peak; "
            f"loss {_num(n.get('loss_first'), '{:.2f}')} → {_num(n.get('loss_last'), '{:.2f}')}"
        )
    if name == "passkey":
        accuracy = (
            f"accuracy {_num(n.get('accuracy'), '{:.0%}')} of {n.get('samples')}"
            if n.get("accuracy_meaningful")
            else "accuracy not meaningful (untrained export)"
        )
        return (
            f"{_num(n.get('length'), '{:,}')} tokens: {_num(n.get('tokens_per_s'), '{:,.0f}')} tok/s, "
            f"{_num(n.get('peak_gpu_mib'), '{:,.0f}')} MiB GPU peak; {accuracy}"
        )
    return ""


def markdown(report: dict, json_name: str) -> str:
    """The run's table for docs/gpu-check.md."""
    m, source = report["machine"], report.get("source", {})
    commit = source.get("commit")
    code = f"`{commit[:10]}`" + (" + uncommitted changes" if source.get("dirty") else "") if commit else "unknown"
    mode = "CUDA" if report["mode"] == "cuda" else "CPU dry run (tiny shapes, not a GPU result)"
    ok = len(report["summary"].get("stages_ok", []))
    lines = [
        f"Run of {report['started']} ({mode}), [results/gpu/{json_name}](results/gpu/{json_name}): "
        f"**{ok} of {len(report['stages'])} stages "
        f"ok in {_num(report.get('seconds'))} s** of a {_num(report.get('budget_s'), '{:.0f}')} s budget.",
        f"Machine: {m.get('device') or 'no GPU'} ({m.get('capability') or '-'}, {m.get('memory_gib') or '-'} GiB), "
        f"torch {m.get('torch')}, triton {m.get('triton')}, CUDA {m.get('cuda')}, Python {m.get('python')}. "
        f"Code: {code}.",
        "",
        "| stage | status | s | box s | numbers |",
        "|---|---|---|---|---|",
    ]
    for name, stage in report["stages"].items():
        lines.append(
            f"| {name} | {stage.get('status')} | {_num(stage.get('seconds'))} | {_num(stage.get('timeout_s'))} | "
            f"{stage_numbers(name, stage)} |"
        )
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, docs: Path) -> str:
    """``text`` with the lines between RESULTS_BEGIN and RESULTS_END replaced by ``block``."""
    if text.count(RESULTS_BEGIN) != 1 or text.count(RESULTS_END) != 1:
        raise PublishError(f"{docs} needs the lines {RESULTS_BEGIN!r} and {RESULTS_END!r} once each")
    head, rest = text.split(RESULTS_BEGIN)
    _, tail = rest.split(RESULTS_END)
    return f"{head}{RESULTS_BEGIN}\n{block}{RESULTS_END}{tail}"


def publish(json_path: Path, results_dir: Path, docs: Path) -> tuple[Path, str]:
    """Write the JSON copy and the docs table; returns the JSON's new path and the table."""
    report = load_report(json_path)
    try:
        text = docs.read_text()
    except OSError as err:
        raise PublishError(f"{docs}: {err.strerror}") from None
    name = result_name(report)
    table = markdown(report, name)
    updated = replace_block(text, table, docs)
    results_dir.mkdir(parents=True, exist_ok=True)
    target = results_dir / name
    write_text(target, json.dumps(report, indent=2) + "\n")
    write_text(docs, updated)
    return target, table

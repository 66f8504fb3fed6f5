"""Merge the demo's evaluation outputs into ``passkey.json``, ``ppl.json``, ``ruler.json``, plots and
``results.md``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from data_prep.json_file import read_json  # noqa: E402
from data_prep.safe_write import replacing, write_text  # noqa: E402
from pipeline.evaluation.plots import plot_ppl_models, short_length  # noqa: E402
from pipeline.evaluation.report import (  # noqa: E402
    needle_fetched_table,
    passkey_table,
    passkey_time_table,
    pool_passkey,
    ppl_table,
    read_result,
    ruler_section,
)
from pipeline.train.metrics import processor  # noqa: E402

log = logging.getLogger(__name__)


def collect_passkey(run_dir: Path, models: list[str]) -> tuple[list[dict], int | None]:
    """One row per (model, length): accuracy and exact match pooled over depths, weighted by samples."""
    rows, train_len = [], None
    for model in models:
        results = []
        for path in sorted((run_dir / "eval" / model).glob("passkey_*/passkey.json")):
            data = read_result(path, "passkey")
            train_len = data["train_seq_len"] or train_len
            results += data["results"]
        rows += [{"model": model, **r} for r in pool_passkey(results)]
    return rows, train_len


def collect_ppl(run_dir: Path, models: list[str]) -> list[dict]:
    """Every model's ``--task ppl`` rows (by context length, then the whole-document row), each with a "model" key.
    A result of the older format (one window set per length, no "kind") is left out with a warning."""
    rows = []
    for model in models:
        path = run_dir / "eval" / model / "ppl" / "ppl.json"
        if not path.is_file():
            continue
        raw = read_json(path)
        if isinstance(raw, dict) and any(isinstance(r, dict) and "kind" not in r for r in raw.get("results", [])):
            log.warning("%s is of an older format (different text per length); delete it to evaluate again", path)
            continue
        rows += [{"model": model, **r} for r in read_result(path, "ppl")["results"]]
    return rows


def _plot(rows: list[dict], metric: str, ylabel: str, train_len: int | None, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        ax.plot([r["length"] for r in mine], [r[metric] for r in mine], marker="o", label=model)
    if train_len:
        ax.axvline(train_len, color="gray", linestyle="--", label=f"training length {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with replacing(path) as png:
        fig.savefig(png, dpi=120, format="png")  # the temporary name has no .png suffix
    plt.close(fig)


def _passkey_tables(rows: list[dict], models: list[str], train_len: int | None) -> list[str]:
    """Accuracy and seconds per sample of the main demo's passkey rows (none when only the two-hop part ran)."""
    if not rows:
        return []
    return [
        f"Passkey retrieval, accuracy of the first answer token (all answer tokens in brackets); "
        f"models trained on {train_len}-token sequences.",
        "",
        passkey_table(rows, models),
        "",
        "Seconds per passkey sample (building it, streaming the prefix, decoding the answer).",
        "",
        passkey_time_table(rows, models),
        "",
        *needle_fetched_table(rows, models),
    ]


_HOP_CHECKS = {
    "first_hop_link": "first hop: the link (row after the name)",
    "first_hop_distractor_link": "the same row: a distractor's link",
    "second_hop_key": "second hop: the asked key needle (row read by the answer)",
    "second_hop_distractor_key": "the same row: a distractor's key needle",
}


def collect_hop_retrieval(run_dir: Path, models: list[str]) -> list[dict]:
    """Per (model, group): how often each retrieval check of ``HopChunks.followed`` held, pooled over every
    length and depth of ``<run_dir>/eval/<model>/passkey_*/passkey.json``."""
    rows = []
    for model in models:
        counts: dict[str, dict[str, list[int]]] = {}
        for path in sorted((run_dir / "eval" / model).glob("passkey_*/passkey.json")):
            for r in read_result(path, "passkey")["results"]:
                for group, checks in r.get("retrieval", {}).items():
                    for check, c in checks.items():
                        total = counts.setdefault(group, {}).setdefault(check, [0, 0])
                        total[0] += c["hits"]
                        total[1] += c["n"]
        for group in sorted(counts):
            rows.append({"model": model, "group": group, **{k: tuple(v) for k, v in counts[group].items()}})
    return rows


def _hop_retrieval_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "Which chunks each retrieval group fetched for the question (all lengths and depths pooled): the hops are "
        "followed when the row after the name holds the link and the answer's row holds the asked key needle "
        "without the distractor's.",
        "",
        "| model | group | " + " | ".join(_HOP_CHECKS.values()) + " |",
        "|---" * (len(_HOP_CHECKS) + 2) + "|",
    ]
    for r in rows:
        cells = [f"{100 * r[k][0] / r[k][1]:.0f}% (n={r[k][1]})" if r.get(k) and r[k][1] else "–" for k in _HOP_CHECKS]
        lines.append(f"| {r['model']} | {r['group']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _multihop_section(run_dir: Path, models: list[str]) -> list[str]:
    """The two-hop results (``<run_dir>/multihop``), merged into ``multihop/passkey.json`` and ``multihop.png``."""
    rows, train_len = collect_passkey(run_dir / "multihop", models)
    if not rows:
        return []
    write_text(
        run_dir / "multihop" / "passkey.json",
        json.dumps({"train_seq_len": train_len, "variant": "multihop", "results": rows}, indent=2),
    )
    _plot(rows, "accuracy", "two-hop accuracy (first answer token)", train_len, run_dir / "multihop.png")
    return [
        "Two-hop retrieval (`--task passkey variant=multihop`): the question names A, a link needle says A leads to "
        "B, a key needle holds B's pass key, plus distractor chains; accuracy of the first answer token (all "
        f"answer tokens in brackets); models trained on {train_len}-token sequences with the two-hop needle mix. "
        "gca_2groups has two retrieval groups, gca one (the control).",
        "",
        passkey_table(rows, models),
        "",
        *_hop_retrieval_table(collect_hop_retrieval(run_dir / "multihop", models)),
    ]


def _ruler_results(model_dir: Path) -> list[dict]:
    """The rows of a model's RULER runs: ``ruler`` (the main one), then ``ruler_0``, ``ruler_1``, ...
    (``ruler_slices``)."""
    numbered = [p for p in model_dir.glob("ruler_*/ruler.json") if p.parent.name.split("_", 1)[1].isdigit()]
    extra = sorted(numbered, key=lambda p: int(p.parent.name.split("_", 1)[1]))  # a folder of another name is not ours
    paths = [model_dir / "ruler" / "ruler.json", *extra]
    return [row for path in paths if path.is_file() for row in read_result(path, "ruler")["results"]]


def collect_ruler(run_dir: Path, models: list[str]) -> list[dict]:
    """Every model's ``--task ruler`` rows, each with a "model" key (models without a RULER result left out)."""
    return [{"model": model, **r} for model in models for r in _ruler_results(run_dir / "eval" / model)]


def collect_seed_ruler(seed_runs: dict[int, tuple[Path, Path]]) -> list[dict]:
    """The GCA model's RULER rows of every training seed that has them, each with ``seed``."""
    return [{"seed": seed, **r} for seed, (run, _) in seed_runs.items() for r in _ruler_results(run / "eval" / "gca")]


def collect_seeds(seed_runs: dict[int, tuple[Path, Path]]) -> list[dict]:
    """The GCA model's passkey rows of every training seed, each with ``seed`` and ``haystack`` (``main``: the
    demo's own, ``collect_passkey`` of the seed's run directory; ``prose``: of its prose directory)."""
    rows = []
    for seed, (run, prose) in seed_runs.items():
        for haystack, where in (("main", run), ("prose", prose)):
            rows += [{"seed": seed, "haystack": haystack, **r} for r in collect_passkey(where, ["gca"])[0]]
    return rows


def _span(values: list[float]) -> str:
    """``min-max%`` of fractions (one number when they agree)."""
    low, high = f"{100 * min(values):.0f}", f"{100 * max(values):.0f}"
    return f"{low}%" if low == high else f"{low}-{high}%"


def _seeds_section(rows: list[dict]) -> list[str]:
    """Per training seed and haystack, the GCA model's passkey accuracy by length; then the minimum and maximum
    over the seeds per length."""
    if not rows:
        return []
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["seed"], r["haystack"], r["length"]): r for r in rows}
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    lines = [
        "Passkey of the GCA model across training seeds (`seeds`; initial weights, data order, needles and Gumbel "
        "noise; the same evaluation samples): first answer token (all answer tokens in brackets); prose = the "
        "`prose` haystack. min / max: over the seeds, per length.",
        "",
        "| seed | haystack | " + " | ".join(short_length(n) for n in lengths) + " |",
        "|---" * (len(lengths) + 2) + "|",
    ]
    for haystack in ("main", "prose"):
        mine = [r for r in rows if r["haystack"] == haystack]
        if not mine:
            continue
        for seed in seeds:
            cells = [cell.get((seed, haystack, n)) for n in lengths]
            if any(cells):
                text = [
                    "–" if r is None else f"{100 * r['accuracy']:.0f}% ({100 * r['exact_match']:.0f}%)" for r in cells
                ]
                lines.append(f"| {seed} | {haystack} | " + " | ".join(text) + " |")
        spread = []
        for n in lengths:
            got = [r for r in mine if r["length"] == n]
            spread.append(
                "–" if not got else f"{_span([r['accuracy'] for r in got])} ({_span([r['exact_match'] for r in got])})"
            )
        lines.append(f"| min-max over {len({r['seed'] for r in mine})} | {haystack} | " + " | ".join(spread) + " |")
    return [*lines, ""]


def _seed_ruler_section(rows: list[dict]) -> list[str]:
    """Per RULER task and length, each training seed's score and the minimum and maximum over the seeds."""
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    if len(seeds) < 2:
        return []
    cells = list(dict.fromkeys((r["task"], r["length"]) for r in rows))
    score = {(r["seed"], r["task"], r["length"]): r for r in rows}
    lines = [
        "RULER of the GCA model across training seeds (`seed_ruler`): each task's score x 100 per seed (samples in "
        "brackets), then the minimum and maximum over the seeds.",
        "",
        "| task | length | " + " | ".join(f"seed {s}" for s in seeds) + " | min-max |",
        "|---|---:" + "|---:" * (len(seeds) + 1) + "|",
    ]
    for task, length in cells:
        got = [score.get((seed, task, length)) for seed in seeds]
        text = ["–" if r is None else f"{100 * r['score']:.0f} ({r['n']})" for r in got]
        spread = _span([r["score"] for r in got if r is not None])
        lines.append(f"| {task} | {short_length(length)} | " + " | ".join(text) + f" | {spread} |")
    return [*lines, ""]


def write_report(
    run_dir: Path,
    models: list[str],
    timings: dict[str, float],
    multihop_models: list[str] | None = None,
    seed_runs: dict[int, tuple[Path, Path]] | None = None,
) -> str:
    """Write the merged JSONs, plots and ``results.md``; return the markdown (also printed by the demo).
    ``multihop_models``: the two-hop part's models (a section of its own when they have results). ``seed_runs``:
    ``{training seed: (run directory, prose directory)}`` of the GCA model's runs (``demo.run_seeds``), merged
    into ``seeds.json`` (with their RULER rows under ``ruler`` when they have some) and tables of the spread over
    seeds."""
    passkey, train_len = collect_passkey(run_dir, models)
    ppl = collect_ppl(run_dir, models)
    ruler = collect_ruler(run_dir, models)
    if ruler:
        write_text(run_dir / "ruler.json", json.dumps({"results": ruler}, indent=2))
    write_text(run_dir / "passkey.json", json.dumps({"train_seq_len": train_len, "results": passkey}, indent=2))
    write_text(run_dir / "ppl.json", json.dumps({"train_seq_len": train_len, "results": ppl}, indent=2))
    if passkey:
        _plot(passkey, "accuracy", "passkey accuracy (first answer token)", train_len, run_dir / "passkey.png")
    if ppl:
        by_model = {model: [r for r in ppl if r["model"] == model] for model in models}
        plot_ppl_models(by_model, train_len, "perplexity of the same tokens vs context", run_dir / "ppl.png")
    seeds = collect_seeds(seed_runs or {})
    seed_ruler = collect_seed_ruler(seed_runs or {})
    if seeds or seed_ruler:
        write_text(
            run_dir / "seeds.json",
            json.dumps(
                {"train_seq_len": train_len, "results": seeds, **({"ruler": seed_ruler} if seed_ruler else {})},
                indent=2,
            ),
        )
    timing_lines = [f"| {name} | {seconds:.0f} s |" for name, seconds in timings.items()]
    report = "\n".join(
        [
            "# make demo results",
            "",
            f"Measured on a {processor()}.",
            "",
            *_passkey_tables(passkey, models, train_len),
            *_seeds_section(seeds),
            *ruler_section(ruler, models),
            *_seed_ruler_section(seed_ruler),
            *ppl_table(ppl, models, "windows of the validation split", "whole windows"),
            *_multihop_section(run_dir, multihop_models or []),
            "Stage timings.",
            "",
            "| stage | wall time |",
            "|---|---|",
            *timing_lines,
            f"| total | {sum(timings.values()):.0f} s |",
            "",
        ]
    )
    write_text(run_dir / "results.md", report)
    return report

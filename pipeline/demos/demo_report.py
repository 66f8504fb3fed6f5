"""Merge the demo's evaluation outputs into ``passkey.json``, ``ppl.json``, ``ruler.json``, plots and
``results.md``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from data_prep.safe_write import replacing, write_text
from pipeline.evaluation.plots import plot_ppl_models, short_length  # noqa: E402
from pipeline.evaluation.ruler import markdown_table  # noqa: E402

log = logging.getLogger(__name__)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def collect_passkey(run_dir: Path, models: list[str]) -> tuple[list[dict], int | None]:
    """One row per (model, length): accuracy and exact match pooled over depths, weighted by samples."""
    rows, train_len = [], None
    for model in models:
        pooled: dict[int, dict[str, float]] = {}
        for path in sorted((run_dir / "eval" / model).glob("passkey_*/passkey.json")):
            data = _read(path)
            train_len = data.get("train_seq_len") or train_len
            for r in data["results"]:
                acc = pooled.setdefault(
                    r["length"], {"hits": 0.0, "exact": 0.0, "n": 0, "seconds": 0.0, "fetched": 0, "asked": 0}
                )
                acc["hits"] += r["accuracy"] * r["n"]
                acc["exact"] += r["exact_match"] * r["n"]
                acc["n"] += r["n"]
                acc["seconds"] += r.get("seconds", 0.0)
                for checks in r.get("retrieval", {}).values():
                    if "asked_needle" in checks:
                        acc["fetched"] += checks["asked_needle"]["hits"]
                        acc["asked"] += checks["asked_needle"]["n"]
        for length in sorted(pooled):
            p = pooled[length]
            rows.append(
                {
                    "model": model,
                    "length": length,
                    "accuracy": p["hits"] / p["n"],
                    "exact_match": p["exact"] / p["n"],
                    "n": int(p["n"]),
                    "seconds": round(p["seconds"], 1),
                    # Share of (sample, group) pairs whose question retrieval held the asked needle.
                    **({"needle_fetched": p["fetched"] / p["asked"]} if p["asked"] else {}),
                }
            )
    return rows, train_len


def collect_ppl(run_dir: Path, models: list[str]) -> list[dict]:
    """Every model's ``--task ppl`` rows (by context length, then the whole-document row), each with a "model" key.
    A result of the older format (one window set per length, no "kind") is left out with a warning."""
    rows = []
    for model in models:
        path = run_dir / "eval" / model / "ppl" / "ppl.json"
        if not path.is_file():
            continue
        results = _read(path)["results"]
        if any("kind" not in r for r in results):
            log.warning("%s is of an older format (different text per length); delete it to evaluate again", path)
            continue
        rows += [{"model": model, **r} for r in results]
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


def _table(rows: list[dict], models: list[str]) -> str:
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["model"], r["length"]): r for r in rows}
    head = "| model | " + " | ".join(short_length(n) for n in lengths) + " |"
    lines = [head, "|---" * (len(lengths) + 1) + "|"]
    for model in models:
        cells = []
        for n in lengths:
            r = cell.get((model, n))
            cells.append(
                "–" if r is None else f"{100 * r['accuracy']:.0f}% ({100 * r['exact_match']:.0f}%, n={r['n']})"
            )
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _time_table(rows: list[dict], models: list[str]) -> str:
    """Seconds per passkey sample (building, streaming and decoding), by model and length."""
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["model"], r["length"]): f"{r['seconds'] / r['n']:.1f} s" for r in rows if r.get("seconds")}
    lines = ["| model | " + " | ".join(short_length(n) for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for model in models:
        lines.append(f"| {model} | " + " | ".join(cell.get((model, n), "–") for n in lengths) + " |")
    return "\n".join(lines)


def _passkey_tables(rows: list[dict], models: list[str], train_len: int | None) -> list[str]:
    """Accuracy and seconds per sample of the main demo's passkey rows (none when only the two-hop part ran)."""
    if not rows:
        return []
    return [
        f"Passkey retrieval, accuracy of the first answer token (all answer tokens in brackets); "
        f"models trained on {train_len}-token sequences.",
        "",
        _table(rows, models),
        "",
        "Seconds per passkey sample (building it, streaming the prefix, decoding the answer).",
        "",
        _time_table(rows, models),
        "",
        *_fetched_table(rows, models),
    ]


def _fetched_table(rows: list[dict], models: list[str]) -> list[str]:
    """How often the question's retrieval held the asked needle (``retrieval.g<i>.asked_needle``), by model and
    length: a wrong answer with the needle fetched is a copy error, without it a retrieval error."""
    cell = {(r["model"], r["length"]): f"{100 * r['needle_fetched']:.0f}%" for r in rows if "needle_fetched" in r}
    if not cell:
        return []
    lengths = sorted({r["length"] for r in rows})
    lines = [
        "How often the question's retrieval held the asked needle (every retrieval group counted): a miss is a "
        "retrieval error; an answer wrong although the needle was fetched, a copy error.",
        "",
        "| model | " + " | ".join(short_length(n) for n in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for model in models:
        if any((model, n) in cell for n in lengths):
            lines.append(f"| {model} | " + " | ".join(cell.get((model, n), "–") for n in lengths) + " |")
    return [*lines, ""]


def _ppl_table(rows: list[dict], models: list[str]) -> list[str]:
    """The caption and table of the perplexity rows: one column per context length, one of whole windows."""
    context = [r for r in rows if r["kind"] == "context"]
    if not context:
        return []
    lengths = sorted({r["length"] for r in context})
    cell = {(r["model"], r.get("length")): f"{r['ppl']:.2f}" for r in rows}
    first = context[0]
    lines = [
        f"Perplexity of the same final {first['tokens'] // first['documents']} tokens of {first['documents']} "
        "windows of the validation split, with each length of context; the last column streams each whole window.",
        "",
        "| model | " + " | ".join(short_length(n) for n in lengths) + " | whole windows |",
        "|---" * (len(lengths) + 2) + "|",
    ]
    for model in models:
        cells = [cell.get((model, n), "–") for n in [*lengths, None]]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return [*lines, ""]


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
            for r in _read(path)["results"]:
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
        _table(rows, models),
        "",
        *_hop_retrieval_table(collect_hop_retrieval(run_dir / "multihop", models)),
    ]


def collect_ruler(run_dir: Path, models: list[str]) -> list[dict]:
    """Every model's ``--task ruler`` rows, each with a "model" key (models without a RULER result left out)."""
    rows = []
    for model in models:
        path = run_dir / "eval" / model / "ruler" / "ruler.json"
        if path.is_file():
            rows += [{"model": model, **r} for r in _read(path)["results"]]
    return rows


def _ruler_section(rows: list[dict], models: list[str]) -> list[str]:
    """Per model, the RULER table (each task's RULER score x 100 per task and length, held-out families marked)."""
    if not rows:
        return []
    n = sorted({r["n"] for r in rows})
    lines = [
        "RULER-style tasks (`--task ruler`, docs/evaluation.md): string_match_all x 100 (QA: string_match_part), "
        f"{'/'.join(map(str, n))} sample(s) per cell; held out = a family the training mix never draws.",
        "",
    ]
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        if mine:
            lines += [f"**{model}**", "", markdown_table(mine)]
    return lines


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
    into ``seeds.json`` and a table of the spread over seeds."""
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
    if seeds:
        write_text(run_dir / "seeds.json", json.dumps({"train_seq_len": train_len, "results": seeds}, indent=2))
    timing_lines = [f"| {name} | {seconds:.0f} s |" for name, seconds in timings.items()]
    report = "\n".join(
        [
            "# make demo results",
            "",
            *_passkey_tables(passkey, models, train_len),
            *_seeds_section(seeds),
            *_ruler_section(ruler, models),
            *_ppl_table(ppl, models),
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

"""``make demo-lm``'s results: every model's perplexity-by-context rows in one ``ppl.json``, one plot, and
``results.md`` with the table, the claims checked against the numbers, the models' sizes and the stage timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

from data_prep.safe_write import write_text
from pipeline.evaluation.plots import plot_ppl_models, short_length
from pipeline.train.metrics import processor

GCA_VS_BASELINE_FROM = 4096
"""The claim compares GCA with the sliding-window model at this context length and beyond."""
FLAT = 0.01
"""A relative change of perplexity within this is reported as flat, not as a fall or a rise."""
WELL_ABOVE = 1.5
"""Far recall at least this many times the random picks' rate is "well above random"."""


def collect(run_dir: Path, models: list[str]) -> tuple[list[dict], int | None, dict[str, int]]:
    """``(rows with a "model" key, the training length, parameters per model)`` from ``eval/<model>/ppl.json``."""
    rows: list[dict] = []
    train_len: int | None = None
    params: dict[str, int] = {}
    for model in models:
        path = run_dir / "eval" / model / "ppl.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        train_len = data.get("train_seq_len") or train_len
        rows += [{"model": model, **row} for row in data["results"]]
        config = run_dir / model / "export" / "config.json"
        if config.is_file():
            params[model] = _parameters(config)
    return rows, train_len, params


def _parameters(config: Path) -> int:
    from model import build_model, count_parameters, read_export_config

    cfg, _ = read_export_config(config.parent)
    return count_parameters(build_model(cfg))


def claims(rows: list[dict], train_len: int | None) -> list[str]:
    """The demo's three claims, each stated with the numbers that decide it (never a bare yes/no)."""
    ppl = {(r["model"], r["length"]): r["ppl"] for r in rows if r.get("kind") == "context"}
    lengths = sorted({length for _, length in ppl})
    lines = []
    gca_lengths = [n for n in lengths if ("gca", n) in ppl]
    if len(gca_lengths) > 1:
        first, last = ppl[("gca", gca_lengths[0])], ppl[("gca", gca_lengths[-1])]
        change = last / first - 1
        trend = " -> ".join(f"{ppl[('gca', n)]:.2f}" for n in gca_lengths)
        span = f"{short_length(gca_lengths[0])} to {short_length(gca_lengths[-1])}"
        if change < -FLAT:
            verdict = f"holds: it falls by {-change:.1%} from {span}"
        elif change <= FLAT:
            verdict = (
                f"holds only as 'does not rise': it changes by {change:+.2%} from {span}, so far context neither "
                "helps nor hurts"
            )
        else:
            verdict = f"does not hold: it rises by {change:.1%} from {span}"
        steps = zip(gca_lengths, gca_lengths[1:])
        rises = [
            f"{ppl[('gca', b)] / ppl[('gca', a)] - 1:.1%} from {short_length(a)} to {short_length(b)}"
            for a, b in steps
            if ppl[("gca", b)] > ppl[("gca", a)] * (1 + FLAT)
        ]
        if rises and change <= FLAT:
            verdict += f", though it rises {', '.join(rises)}"
        lines.append(f"GCA's perplexity falls (or at least does not rise) as context grows ({trend}): {verdict}.")
    compared = [n for n in lengths if n >= GCA_VS_BASELINE_FROM and ("gca", n) in ppl and ("baseline", n) in ppl]
    if compared:
        cells = ", ".join(f"{short_length(n)}: {ppl[('gca', n)]:.2f} vs {ppl[('baseline', n)]:.2f}" for n in compared)
        worse = [short_length(n) for n in compared if ppl[("gca", n)] > ppl[("baseline", n)]]
        verdict = "holds" if not worse else f"does not hold at {', '.join(worse)}"
        lines.append(f"GCA <= the sliding-window model at every length >= 4K (GCA vs baseline, {cells}): {verdict}.")
    if train_len and ("full", train_len) in ppl:
        past = [n for n in lengths if n > train_len and ("full", n) in ppl]
        if past:
            ratios = ", ".join(f"{short_length(n)}: {ppl[('full', n)] / ppl[('full', train_len)]:.2f}x" for n in past)
            lines.append(
                f"Full attention's perplexity past its training length, relative to "
                f"{short_length(train_len)}: {ratios}."
            )
    return lines


def mix_claims(rows: list[dict]) -> list[str]:
    """The retrieval-mix claims, each with the numbers that decide it: ``gca_mix``'s perplexity at 16K and 64K
    below its 1K one; ``gca_mix`` below ``gca_random`` at every length; ``gca_mix``'s far recall well above the
    rate of random picks."""
    context = [r for r in rows if r.get("kind") == "context"]
    ppl = {(r["model"], r["length"]): r["ppl"] for r in context}
    lines = []
    mix_lengths = sorted(n for m, n in ppl if m == "gca_mix")
    if len(mix_lengths) > 1:
        first = mix_lengths[0]
        later = [n for n in mix_lengths if n >= 16384]
        cells = ", ".join(f"{short_length(n)}: {ppl[('gca_mix', n)]:.2f}" for n in later)
        above = [short_length(n) for n in later if ppl[("gca_mix", n)] >= ppl[("gca_mix", first)]]
        verdict = "holds" if later and not above else f"does not hold at {', '.join(above)}" if above else "untested"
        lines.append(
            f"gca_mix's perplexity at 16K and 64K is below its {short_length(first)} one "
            f"({ppl[('gca_mix', first)]:.2f}; {cells or 'no such length'}): {verdict}."
        )
    both = sorted(n for m, n in ppl if m == "gca_mix" and ("gca_random", n) in ppl)
    if both:
        cells = ", ".join(f"{short_length(n)}: {ppl[('gca_mix', n)]:.2f} vs {ppl[('gca_random', n)]:.2f}" for n in both)
        worse = [short_length(n) for n in both if ppl[("gca_mix", n)] >= ppl[("gca_random", n)]]
        verdict = "holds" if not worse else f"does not hold at {', '.join(worse)}"
        lines.append(f"gca_mix < gca_random (the random-retriever ablation) at every length ({cells}): {verdict}.")
    recall = [r for r in context if r["model"] == "gca_mix" and r.get("far_recall") is not None]
    if recall:
        cells = ", ".join(
            f"{short_length(r['length'])}: {r['far_recall']:.3f} vs {r['far_recall_random']:.3f}" for r in recall
        )
        low = [short_length(r["length"]) for r in recall if r["far_recall"] < WELL_ABOVE * r["far_recall_random"]]
        verdict = "holds" if not low else f"does not hold at {', '.join(low)}"
        lines.append(
            f"gca_mix's far recall is well above random picks' (at least {WELL_ABOVE}x; far recall vs random, "
            f"{cells}): {verdict}."
        )
    return lines


def _recall_cell(row: dict) -> str:
    nearest = f" / {row['far_recall_nearest']:.3f}" if row.get("far_recall_nearest") is not None else ""
    return f"{row['far_recall']:.3f} / {row['far_recall_random']:.3f}{nearest} ({row['far_recall_tokens']})"


def far_recall_table(rows: list[dict], models: list[str]) -> str | None:
    """Per GCA model and context length: far recall, the random picks' rate, the recency rule's (when the row has
    it) and the tokens it is measured on."""
    cells = {
        (r["model"], r["length"]): r
        for r in rows
        if r.get("kind") == "context" and r.get("far_recall") is not None and r["model"] in models
    }
    if not cells:
        return None
    lengths = sorted({n for _, n in cells})
    lines = [
        "| model | " + " | ".join(short_length(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for model in [m for m in models if any(key[0] == m for key in cells)]:
        row = [_recall_cell(c) if (c := cells.get((model, n))) else "-" for n in lengths]
        lines.append(f"| {model} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def mix_accuracy(run_dir: Path, models: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """``{model: {family: {length: exact match over its depths and samples}}}`` from ``eval/<model>/mix/``."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for model in models:
        root = run_dir / "eval" / model / "mix"
        for path in sorted(root.glob("*/passkey.json")) if root.is_dir() else []:
            by_length: dict[int, list[float]] = {}
            for row in json.loads(path.read_text())["results"]:
                by_length.setdefault(row["length"], []).append(row["exact_match"])
            family = out.setdefault(model, {}).setdefault(path.parent.name, {})
            family.update({n: sum(v) / len(v) for n, v in by_length.items()})
    return out


def mix_table(accuracy: dict[str, dict[str, dict[int, float]]]) -> str | None:
    if not accuracy:
        return None
    lengths = sorted({n for families in accuracy.values() for by in families.values() for n in by})
    models = list(accuracy)
    header = [f"{m} {short_length(n)}" for m in models for n in lengths]
    lines = ["| family | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    families = sorted({f for families in accuracy.values() for f in families}, key=_family_order)
    for family in families:
        row = [
            f"{accuracy[m][family][n]:.2f}" if n in accuracy.get(m, {}).get(family, {}) else "-"
            for m in models
            for n in lengths
        ]
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _family_order(family: str) -> int:
    from pipeline.data.retrieval_tasks import FAMILIES

    return FAMILIES.index(family) if family in FAMILIES else len(FAMILIES)


GCA_MODELS = ("gca", "gca_mix", "gca_random", "gca_doc")


def retrieval_summary(run_dir: Path, model: str = "gca") -> str | None:
    """What ``model``'s retriever did at its last training step, next to what random picks would give: the entropy
    of the top-k weights against ``ln(top_k)`` (uniform), the mean distance to the retrieved chunks against
    uniformly random picks among the visible chunks, and the far recall of its last validation. ``None`` without
    that model's run."""
    metrics, config = run_dir / model / "metrics.jsonl", run_dir / model / "config.yaml"
    if not metrics.is_file() or not config.is_file():
        return None
    last = recall = None
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "retrieval_entropy_g0" in record:
            last = record
        if record.get("retrieval/far_recall") is not None:
            recall = record
    if last is None:
        return None
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config)
    top_k, chunks = int(cfg.model.top_k), int(cfg.train.seq_len) // int(cfg.model.chunk_size)
    # Query chunk i (1 <= i < chunks) picks among chunks j < i and is read by chunk i + 1: a uniformly random pick
    # lies (i + 3) / 2 chunks back on average.
    random_distance = sum((i + 3) / 2 for i in range(1, chunks)) / (chunks - 1)
    text = (
        f"{model}'s retriever at its last training step (step {last['step']}): weight entropy "
        f"{last['retrieval_entropy_g0']:.2f} nats over its top-{top_k} (uniform: ln {top_k} = {math.log(top_k):.2f}), "
        f"mean distance {last['retrieval_distance_g0']:.1f} chunks back (uniformly random picks among the visible "
        f"chunks of a {cfg.train.seq_len}-token sequence: {random_distance:.1f})"
    )
    if recall is not None:
        text += (
            f"; far recall on the validation split at step {recall['step']}: {recall['retrieval/far_recall']:.3f} "
            f"(random picks: {recall['retrieval/far_recall_random']:.3f})"
        )
    return text + "."


def _table(rows: list[dict], models: list[str]) -> str:
    context = [r for r in rows if r.get("kind") == "context"]
    lengths = sorted({r["length"] for r in context})
    cell = {(r["model"], r["length"]): r for r in context}
    document = {r["model"]: r for r in rows if r.get("kind") == "document"}
    lines = [
        "| model | " + " | ".join(short_length(n) for n in lengths) + " | whole documents |",
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for model in models:
        cells = [f"{cell[(model, n)]['ppl']:.2f}" if (model, n) in cell else "-" for n in lengths]
        doc = document.get(model)
        cells.append(f"{doc['ppl']:.2f}" if doc else "-")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    first = next(iter(cell.values()), None)
    if first:
        lines.append("")
        lines.append(
            f"Every cell scores the same {first['tokens']} tokens ({first['documents']} documents); only the context "
            'before them grows. "whole documents": every token of each document streamed from its start.'
        )
    return "\n".join(lines)


def write_demo_lm_report(run_dir: Path, models: list[str], timings: dict[str, float]) -> str:
    """Write ``ppl.json``, ``ppl.png`` and ``results.md`` into ``run_dir``; return the markdown."""
    rows, train_len, params = collect(run_dir, models)
    documents_path = run_dir / "eval_docs.json"
    documents = json.loads(documents_path.read_text()) if documents_path.is_file() else []
    payload = {"train_seq_len": train_len, "documents": documents, "parameters": params, "results": rows}
    write_text(run_dir / "ppl.json", json.dumps(payload, indent=2) + "\n")
    by_model = {m: [r for r in rows if r["model"] == m] for m in models if any(r["model"] == m for r in rows)}
    plot_ppl_models(by_model, train_len, "perplexity of the same tokens vs context", run_dir / "ppl.png")
    doc_list = ", ".join(f"{d['name']} ({d['files']} files, {d['tokens']} tokens)" for d in documents)
    parts = [
        "# make demo-lm results",
        "",
        f"Measured on a {processor()}.",
        "",
        f"Perplexity of the last tokens of each held-out document given growing context; models trained on "
        f"{train_len}-token sequences. Documents (standard-library packages never trained on, each package's modules "
        f"joined into one document): {doc_list}.",
        "",
        _table(rows, models),
        "",
        "## Claims",
        "",
        *[f"- {line}" for line in [*claims(rows, train_len), *mix_claims(rows)]],
        "",
        *[f"{summary}\n" for m in GCA_MODELS if m in models and (summary := retrieval_summary(run_dir, m))],
        *(
            [
                "## Far recall",
                "",
                "For each scored token that completes a 4-token sequence whose earlier occurrence lies beyond the "
                "sliding-window reach: how often the retrieved chunks held that occurrence / the rate of uniformly "
                "random picks among the visible chunks / the rate of the recency rule that takes the top-k chunks "
                "nearest beyond the reach, reading nothing (and the number of such tokens).",
                "",
                recall,
                "",
            ]
            if (recall := far_recall_table(rows, models))
            else []
        ),
        *(
            [
                "## The mix's task families",
                "",
                "Exact match (every answer token right) of each family's samples over the held-out text "
                "(`--task passkey variant=<family>`, five depths), per model and length.",
                "",
                table,
                "",
            ]
            if (table := mix_table(mix_accuracy(run_dir, models)))
            else []
        ),
        "## Models and stage timings",
        "",
        "| model | parameters |",
        "|---|---|",
        *[f"| {m} | {params[m]:,} |" for m in models if m in params],
        "",
        "| stage | wall time |",
        "|---|---|",
        *[f"| {name} | {seconds:.0f} s |" for name, seconds in timings.items()],
        f"| total | {sum(timings.values()):.0f} s |",
    ]
    markdown = "\n".join(parts) + "\n"
    write_text(run_dir / "results.md", markdown)
    return markdown

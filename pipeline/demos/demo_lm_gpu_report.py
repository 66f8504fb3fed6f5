"""``make demo-lm-gpu``'s results, rebuilt from the finished stages' numbers after every stage: the tables and the
four claims in ``demo-lm-gpu.json``'s ``summary``, ``results.md`` and ``ppl.png``. A claim whose stages did not
finish is reported as untested, naming them; a claim is never judged without its numbers."""

from __future__ import annotations

from pathlib import Path

from data_prep.safe_write import write_text
from pipeline.evaluation.plots import plot_ppl_models, short_length


def _numbers(results: dict[str, dict], name: str) -> dict | None:
    res = results.get(name, {})
    return res.get("numbers") if res.get("status") == "ok" else None


def _by_length(rows: list[dict], key: str) -> dict[int, float]:
    """``{length: mean of key}`` over the rows of each length (passkey: one row per depth)."""
    values: dict[int, list[float]] = {}
    for row in rows:
        values.setdefault(row["length"], []).append(row[key])
    return {n: sum(v) / len(v) for n, v in sorted(values.items())}


def training(results: dict[str, dict], models: list[str]) -> dict[str, dict]:
    """Per trained model: steps, tokens, passes over the training books, throughput and loss."""
    prep = _numbers(results, "prep") or {}
    train_tokens = prep.get("train_tokens")
    out = {}
    for model in models:
        numbers = _numbers(results, f"train-{model}")
        if numbers is None:
            continue
        tokens = numbers["tokens_trained"]
        out[model] = {
            "steps": numbers["steps"],
            "tokens_trained": tokens,
            "epochs": tokens / train_tokens if train_tokens else None,
            "tokens_per_s": numbers["tokens_per_s"],
            "step_time_s": numbers["step_time_s"],
            "peak_mem_gb": numbers["peak_mem_gb"],
            "loss_first": numbers["loss_first"],
            "loss_last": numbers["loss_last"],
            "stage_seconds": results[f"train-{model}"]["seconds"],
        }
    return out


def _context_rows(results: dict[str, dict], name: str) -> list[dict]:
    numbers = _numbers(results, name)
    return [r for r in numbers["rows"] if r.get("kind") == "context"] if numbers else []


def summarize(results: dict[str, dict], experiment: dict) -> dict:
    """Everything ``results.md`` shows, from the stage numbers (``Runner.results``) alone."""
    models = experiment["models"]
    ppl: dict[str, dict[int, float]] = {}
    ppl_long: dict[str, dict[int, float]] = {}
    recall: dict[str, dict[int, dict]] = {}
    passkey: dict[str, dict[int, float]] = {}
    ruler: dict[str, dict[int, float]] = {}
    scored: dict[str, dict] = {}
    train_len = None
    for model in models:
        for kind, table in (("ppl", ppl), ("ppl_long", ppl_long)):
            rows = _context_rows(results, f"{kind}-{model}")
            if rows:
                table[model] = {r["length"]: r["ppl"] for r in rows}
                scored[kind] = {"tokens": rows[0]["tokens"], "documents": rows[0]["documents"]}
                train_len = _numbers(results, f"{kind}-{model}")["train_seq_len"]  # type: ignore[index]
            if kind == "ppl" and any(r.get("far_recall") is not None for r in rows):
                recall[model] = {
                    r["length"]: {
                        "far_recall": r["far_recall"],
                        "uniform": r["far_recall_random"],
                        "recency": r["far_recall_nearest"],
                        "tokens": r["far_recall_tokens"],
                    }
                    for r in rows
                    if r.get("far_recall") is not None
                }
        for kind, table, key in (("passkey", passkey, "exact_match"), ("ruler", ruler, "score")):
            numbers = _numbers(results, f"{kind}-{model}")
            if numbers:
                table[model] = _by_length(numbers["rows"], key)
    return {
        "train_seq_len": train_len,
        "training": training(results, models),
        "scored": scored,
        "ppl": ppl,
        "ppl_long": ppl_long,
        "far_recall": recall,
        "passkey_exact_match": passkey,
        "ruler_niah_single_2": ruler,
        "claims": claims(ppl, ppl_long, recall, train_len, results),
        "stages_ok": sorted(n for n, r in results.items() if r.get("status") == "ok"),
        "stages_not_ok": sorted(n for n, r in results.items() if r.get("status") != "ok"),
    }


def _untested(results: dict[str, dict], stages: list[str]) -> str:
    missing = [
        f"{s} ({results[s]['status']})" if s in results else f"{s} (not run yet)"
        for s in stages
        if results.get(s, {}).get("status") != "ok"
    ]
    return f"untested: {', '.join(missing)} did not finish ok"


def _claim(name: str, statement: str, verdict: str, numbers: dict) -> dict:
    return {"claim": name, "statement": statement, "verdict": verdict, "numbers": numbers}


def claims(
    ppl: dict[str, dict[int, float]],
    ppl_long: dict[str, dict[int, float]],
    recall: dict[str, dict[int, dict]],
    train_len: int | None,
    results: dict[str, dict],
) -> list[dict]:
    """The issue's four claims, each with the numbers that decide it and ``verdict`` ``holds``, ``fails at <lengths>``
    or ``untested: <why>``. "Past the training length" and "from the second length on" stand for 16K/64K and 4K on
    the GPU config, so the CPU dry run's tiny lengths judge the same way."""
    out = []
    gca = ppl.get("gca", {})
    lengths = sorted(gca)
    past = [n for n in lengths if train_len and n > train_len]
    statement = "gca's perplexity past its training length is below its perplexity at the shortest context"
    if gca and past:
        first = lengths[0]
        numbers = {n: gca[n] for n in [first, *past]}
        worse = [short_length(n) for n in past if gca[n] >= gca[first]]
        out.append(_claim("1", statement, f"fails at {', '.join(worse)}" if worse else "holds", numbers))
    else:
        out.append(_claim("1", statement, _untested(results, ["ppl-gca"]), {}))
    for name, other, table_from, wording in (
        ("2", "gca_random", 0, "below gca_random (the random-retriever ablation) at every length"),
        ("3", "swa", 1, "at or below swa (the sliding-window model) at every length from the second on"),
    ):
        statement = f"gca's perplexity is {wording}"
        pairs: dict[str, tuple[float, float]] = {}
        for table in (ppl, ppl_long):
            both = sorted(n for n in table.get("gca", {}) if n in table.get(other, {}))
            key = "" if table is ppl else " (long books)"
            pairs.update({f"{short_length(n)}{key}": (table["gca"][n], table[other][n]) for n in both[table_from:]})
        if not pairs:
            out.append(_claim(name, statement, _untested(results, ["ppl-gca", f"ppl-{other}"]), {}))
            continue
        strict = name == "2"
        worse = [k for k, (a, b) in pairs.items() if (a >= b if strict else a > b)]
        verdict = f"fails at {', '.join(worse)}" if worse else "holds"
        out.append(_claim(name, statement, verdict, {k: {"gca": a, other: b} for k, (a, b) in pairs.items()}))
    statement = "gca's far recall is above the recency rule's from the second length on"
    second = lengths[1] if len(lengths) > 1 else None
    cells = {n: r for n, r in sorted(recall.get("gca", {}).items()) if second is not None and n >= second}
    if cells:
        worse = [short_length(n) for n, r in cells.items() if r["recency"] is None or r["far_recall"] <= r["recency"]]
        verdict = f"fails at {', '.join(worse)}" if worse else "holds"
        out.append(_claim("4", statement, verdict, cells))
    else:
        out.append(_claim("4", statement, _untested(results, ["ppl-gca"]), {}))
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _length_table(table: dict[str, dict[int, float]], models: list[str], digits: int = 2) -> list[str]:
    lengths = sorted({n for by in table.values() for n in by})
    lines = ["| model | " + " | ".join(short_length(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for model in [m for m in models if m in table]:
        lines.append(f"| {model} | " + " | ".join(_fmt(table[model].get(n), digits) for n in lengths) + " |")
    return lines


def _claim_line(claim: dict) -> str:
    numbers = claim["numbers"]
    if claim["claim"] == "1":
        cells = ", ".join(f"{short_length(n)}: {v:.2f}" for n, v in numbers.items())
    elif claim["claim"] == "4":
        cells = ", ".join(
            f"{short_length(n)}: {r['far_recall']:.3f} vs recency {_fmt(r['recency'], 3)}, uniform {r['uniform']:.3f}"
            for n, r in numbers.items()
        )
    else:
        cells = ", ".join(f"{k}: " + " vs ".join(f"{v:.2f}" for v in pair.values()) for k, pair in numbers.items())
    return (
        f"- ({claim['claim']}) {claim['statement']}" + (f" ({cells})" if cells else "") + f": **{claim['verdict']}**."
    )


def markdown(report: dict) -> str:
    """``results.md`` of a (possibly unfinished) run."""
    summary, experiment = report["summary"], report["experiment"]
    models = experiment["models"]
    holdout = experiment["holdout"]
    mode = report["mode"]
    parts = [
        "# make demo-lm-gpu results",
        "",
        f"Mode: {mode}"
        + (" (tiny shapes: the numbers only show that every stage runs)" if mode != "cuda" else "")
        + f"; device: {report['machine'].get('device') or 'cpu'}; {report['seconds']:.0f} s of a "
        f"{report['budget_s']:.0f} s budget.",
        "",
        f"Held out before training ({holdout['rule']}): books {holdout['long_books']} (long) and {holdout['books']}.",
        "",
        "## Training",
        "",
        "| model | steps | tokens | epochs over the training books | tokens/s | s/step | loss first -> last "
        "| stage s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, t in summary["training"].items():
        parts.append(
            f"| {model} | {t['steps']} | {t['tokens_trained']:,} | {_fmt(t['epochs'], 3)} | {t['tokens_per_s']:,.0f} "
            f"| {t['step_time_s']:.3f} | {t['loss_first']:.2f} -> {t['loss_last']:.2f} | {t['stage_seconds']:.0f} |"
        )
    for kind, title in (("ppl", "Perplexity by context"), ("ppl_long", "Perplexity by context, the long books")):
        if summary[kind]:
            scored = summary["scored"][kind]
            parts += [
                "",
                f"## {title}",
                "",
                f"The same final {scored['tokens']} tokens ({scored['documents']} held-out books) at every length.",
                "",
                *_length_table(summary[kind], models),
            ]
    if summary["far_recall"]:
        parts += [
            "",
            "## Far recall",
            "",
            "Scored tokens completing a 4-token sequence seen beyond the sliding reach: how often the retrieved "
            "chunks held it / uniform random picks / the recency rule (the nearest chunks beyond the reach) "
            "(tokens).",
            "",
        ]
        lengths = sorted({n for by in summary["far_recall"].values() for n in by})
        parts += ["| model | " + " | ".join(short_length(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for model, by in summary["far_recall"].items():
            cells = [
                f"{r['far_recall']:.3f} / {r['uniform']:.3f} / {_fmt(r['recency'], 3)} ({r['tokens']})"
                if (r := by.get(n))
                else "-"
                for n in lengths
            ]
            parts.append(f"| {model} | " + " | ".join(cells) + " |")
    for key, title in (("passkey_exact_match", "Passkey exact match"), ("ruler_niah_single_2", "RULER niah_single_2")):
        if summary[key]:
            parts += ["", f"## {title}", "", *_length_table(summary[key], models)]
    parts += ["", "## Claims", "", *[_claim_line(c) for c in summary["claims"]], "", "## Stages", ""]
    parts += ["| stage | status | s | box s |", "|---|---|---|---|"]
    for name, res in report["stages"].items():
        parts.append(f"| {name} | {res['status']} | {res['seconds']} | {res.get('timeout_s', '-')} |")
    return "\n".join(parts) + "\n"


def write_outputs(report: dict, out: Path) -> None:
    """``results.md`` and, once a model has perplexities, ``ppl.png``."""
    write_text(out / "results.md", markdown(report))
    summary = report["summary"]
    if summary["ppl"]:
        rows = {
            m: [{"kind": "context", "length": n, "ppl": v} for n, v in by.items()] for m, by in summary["ppl"].items()
        }
        title = "held-out books: perplexity of the same tokens vs context"
        plot_ppl_models(rows, summary["train_seq_len"], title, out / "ppl.png")

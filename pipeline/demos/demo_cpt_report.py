"""``make demo-cpt``'s results: perplexity by context and passkey accuracy by length of the dense model, its
conversion before training and after each training stage, in ``results.json`` and ``results.md``."""

from __future__ import annotations

import json
from pathlib import Path

from data_prep.safe_write import write_text
from pipeline.demos.demo_report import collect_ruler
from pipeline.evaluation.report import ruler_section
from pipeline.train.metrics import processor

MODELS = ("dense", "converted", "stage1", "stage2")
DESCRIPTIONS = {
    "dense": "the dense Llama (full attention; as an export whose window spans the context)",
    "converted": "converted to GCA, before any training",
    "stage1": "after stage 1 (the config's stage1 keys)",
    "stage2": "after stage 2 (the config's stage2 keys, from stage 1's export)",
}


def ppl_rows(run_dir: Path) -> list[dict]:
    """``{"model", "length", "ppl"}`` of every model's context rows (``eval/<model>/ppl/ppl.json``)."""
    rows = []
    for model in MODELS:
        path = run_dir / "eval" / model / "ppl" / "ppl.json"
        if path.is_file():
            for row in json.loads(path.read_text())["results"]:
                if row.get("kind") == "context":
                    rows.append({"model": model, "length": row["length"], "ppl": row["ppl"], "tokens": row["tokens"]})
    return rows


def passkey_rows(run_dir: Path) -> list[dict]:
    """``{"model", "length", "accuracy", "exact_match", "n", "seconds"}`` per model and length, pooled over depths
    (weighted by samples) from every passkey slice of the model."""
    pooled: dict[tuple[str, int], dict] = {}
    for model in MODELS:
        for path in sorted((run_dir / "eval" / model).glob("passkey_*/passkey.json")):
            for row in json.loads(path.read_text())["results"]:
                acc = pooled.setdefault(
                    (model, row["length"]), {"hits": 0.0, "exact": 0.0, "n": 0, "seconds": 0.0, "fetched": None}
                )
                asked = row.get("retrieval", {}).get("g0", {}).get("asked_needle")
                if asked is not None:  # a model with a retriever
                    acc["fetched"] = (acc["fetched"] or 0) + asked["hits"]
                acc["hits"] += row["accuracy"] * row["n"]
                acc["exact"] += row["exact_match"] * row["n"]
                acc["n"] += row["n"]
                acc["seconds"] += row.get("seconds", 0.0)
    return [
        {
            "model": model,
            "length": length,
            "accuracy": p["hits"] / p["n"],
            "exact_match": p["exact"] / p["n"],
            "n": p["n"],
            "fetched": p["fetched"],
            "seconds": round(p["seconds"], 1),
        }
        for (model, length), p in pooled.items()
        if p["n"]
    ]


def training_summary(run_dir: Path) -> dict[str, dict]:
    """Per trained model: steps, tokens and the mean loss of its last logged steps (dense: ``train_log.json``;
    GCA stages: ``metrics.jsonl``)."""
    summary: dict[str, dict] = {}
    dense = run_dir / "dense_hf" / "train_log.json"
    if dense.is_file():
        log = json.loads(dense.read_text())
        last = [s["loss"] for s in log["steps"][-5:]]
        summary["dense"] = {
            "steps": len(log["steps"]),
            "tokens": log["tokens"],
            "first_loss": log["steps"][0]["loss"],
            "final_loss": sum(last) / len(last),
            "val_loss": log["val_loss"],
            "seconds": log["seconds"],
        }
    for stage in ("stage1", "stage2"):
        metrics = run_dir / stage / "metrics.jsonl"
        if not metrics.is_file():
            continue
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [r for r in records if "loss" in r and "event" not in r]
        if steps:
            last = [r["loss"] for r in steps[-3:]]
            summary[stage] = {
                "steps": steps[-1]["step"],
                "first_loss": steps[0]["loss"],
                "final_loss": sum(last) / len(last),
                # how sharp the first group's top-k retrieval weights are at the end (uniform: ln top_k)
                "retrieval_entropy": steps[-1].get("retrieval_entropy_g0"),
            }
    return summary


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def ppl_table(rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["model"], r["length"]): f"{r['ppl']:.2f}" for r in rows}
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    body = [[m, *(cell.get((m, n), "—") for n in lengths)] for m in models]
    return _table(["model", *(_k(n) for n in lengths)], body)


def passkey_table(rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})
    cell = {
        (r["model"], r["length"]): (
            f"{100 * r['accuracy']:.0f}% ({100 * r['exact_match']:.0f}%, n={r['n']}"
            + ("" if r["fetched"] is None else f"; fetched {r['fetched']}")
            + ")"
        )
        for r in rows
    }
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    body = [[m, *(cell.get((m, n), "—") for n in lengths)] for m in models]
    return _table(["model", *(_k(n) for n in lengths)], body)


def _k(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def write_demo_cpt_report(run_dir: Path, timings: dict[str, float]) -> str:
    """Write ``results.json`` and ``results.md`` from whatever finished; return the markdown."""
    ppl, passkey, training = ppl_rows(run_dir), passkey_rows(run_dir), training_summary(run_dir)
    ruler = collect_ruler(run_dir, list(MODELS))
    check_path = run_dir / "dense_check.json"
    check = json.loads(check_path.read_text()) if check_path.is_file() else None
    write_text(
        run_dir / "results.json",
        json.dumps(
            {
                "ppl": ppl,
                "passkey": passkey,
                "ruler": ruler,
                "training": training,
                "dense_check": check,
                "timings": timings,
            },
            indent=2,
        ),
    )
    parts = ["# make demo-cpt", "", f"Measured on a {processor()}.", ""]
    parts += [f"- `{m}`: {DESCRIPTIONS[m]}" for m in MODELS if (run_dir / "eval" / m).is_dir() or m in training]
    if check:
        parts += [
            "",
            f"The `dense` export against `transformers`' LlamaForCausalLM on {check['tokens']} held-out tokens: "
            f"max |logit difference| {check['max_abs_diff']:.2e} (logits up to {check['max_abs_logit']:.1f}).",
        ]
    if training:
        parts += ["", "## Training", ""]
        body = [
            [
                m,
                str(t["steps"]),
                "—" if t.get("first_loss") is None else f"{t['first_loss']:.3f}",
                f"{t['final_loss']:.3f}",
                "—" if t.get("val_loss") is None else f"{t['val_loss']:.3f}",
                "—" if t.get("retrieval_entropy") is None else f"{t['retrieval_entropy']:.3f}",
            ]
            for m, t in training.items()
        ]
        header = ["model", "steps", "first loss", "loss (last steps)", "val loss", "retrieval entropy (last step)"]
        parts.append(_table(header, body))
    if ppl:
        parts += ["", "## Perplexity of the same held-out tokens by context", "", ppl_table(ppl)]
    if passkey:
        parts += [
            "",
            "## Passkey, accuracy of the first answer token (all answer tokens)",
            "",
            "`fetched`: samples whose question's retrieval held the asked needle's chunk.",
            "",
            passkey_table(passkey),
        ]
    if ruler:
        parts += ["", "## RULER", "", *ruler_section(ruler, [m for m in MODELS if any(r["model"] == m for r in ruler)])]
    if timings:
        parts += ["", "## Stage wall times (s)", ""]
        parts.append(_table(["stage", "seconds"], [[k, f"{v:.0f}"] for k, v in timings.items()]))
    markdown = "\n".join(parts) + "\n"
    write_text(run_dir / "results.md", markdown)
    return markdown

"""One markdown report of evaluation outputs (``python launch/report.py <eval --out dir> ...``), and the tables that
``make demo``'s ``results.md`` shares with it.

A report reads what ``launch/eval.py`` wrote into each directory it is given: ``ppl.json``, ``passkey.json``,
``ruler.json``, their plots (``<task>.png``, linked from the report) and the samples files (``passkey.samples.jsonl``,
``ruler.samples.jsonl``: a few predictions shown with their decoded text). Each directory is one column or row of
the tables, named as it was given; a task a directory lacks is named in the report, not an error. Every JSON file
is read without trusting it (``data_prep.json_file``): a file that is not what the eval writes is one line naming
the file and the field.

The tables (one row per model, one column per length) are ``make demo``'s too: its rows carry a ``model`` key, as
the rows here carry the directory's name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from data_prep.json_file import DEFAULT_MAX_BYTES, Fields, JsonFileError, parse_json, read_json
from data_prep.safe_files import UnsafeDatasetError, read_regular
from data_prep.safe_write import write_text
from pipeline.evaluation.config import TASKS
from pipeline.evaluation.plots import short_length
from pipeline.evaluation.resume import SAMPLES_FILE as PASSKEY_SAMPLES
from pipeline.evaluation.ruler import RULER_TASKS, tables
from pipeline.evaluation.ruler import SAMPLES_FILE as RULER_SAMPLES

REPORT_FILE = "report.md"
MAX_EXAMPLES = 6
"""Sample predictions shown per samples file: the first of each length (passkey) or task (RULER)."""
MAX_TEXT = 60
"""Characters of a decoded text shown in a table cell (longer ones are cut, marked with an ellipsis)."""


class ReportError(ValueError):
    """A report cannot be made (a directory missing or without any result); one line naming it."""


# ---------------------------------------------------------------- reading the eval's files


def _optional(fields: Fields, key: str, take: Callable[..., Any], **bounds: Any) -> Any:
    """``take(key, ...)`` of ``fields``, or None when the value is absent or null (a rate with no count, an export
    without a training length)."""
    return None if fields.obj.get(key) is None else take(key, **bounds)


def _retrieval(row: Fields) -> dict[str, dict[str, dict[str, int]]]:
    """The ``retrieval`` counts of a passkey or RULER row: ``{group: {check: {"hits", "n"}}}``."""
    groups = Fields(row.mapping("retrieval", default={}), row.where, f"{row.prefix}retrieval.")
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for group in groups.obj:
        checks = groups.nested(group)
        for check in checks.obj:
            count = checks.nested(check)
            n = count.integer("n", low=0)
            counts.setdefault(group, {})[check] = {"hits": count.integer("hits", low=0, high=n), "n": n}
    return counts


def _ppl_row(row: Fields) -> dict:
    kind = row.string("kind", choices=("context", "document"))
    out: dict[str, Any] = {
        "kind": kind,
        "ppl": row.number("ppl", low=0),
        "nll": row.number("nll"),
        "tokens": row.integer("tokens", low=0),
        "documents": row.integer("documents", low=0),
        "seconds": row.number("seconds", low=0, default=0.0),
    }
    if kind == "context":
        out["length"] = row.integer("length", low=1)
    if "far_recall_tokens" in row.obj:
        out["far_recall_tokens"] = row.integer("far_recall_tokens", low=0)
        for key in ("far_recall", "far_recall_random", "far_recall_nearest"):
            out[key] = _optional(row, key, row.number, low=0, high=1)
    return out


def _passkey_row(row: Fields) -> dict:
    return {
        "length": row.integer("length", low=1),
        "depth": row.number("depth", low=0, high=1),
        "accuracy": row.number("accuracy", low=0, high=1),
        "exact_match": row.number("exact_match", low=0, high=1),
        "n": row.integer("n", low=1),
        "seconds": row.number("seconds", low=0, default=0.0),
        "retrieval": _retrieval(row),
    }


def _ruler_row(row: Fields) -> dict:
    task = row.string("task", choices=RULER_TASKS)
    return {
        "task": task,
        "length": row.integer("length", low=1),
        "score": row.number("score", low=0, high=1),
        "n": row.integer("n", low=1),
        "seconds": row.number("seconds", low=0, default=0.0),
    }


_ROWS = {"ppl": _ppl_row, "passkey": _passkey_row, "ruler": _ruler_row}


def read_result(path: Path, task: str) -> dict:
    """``<task>.json`` as ``launch/eval.py`` writes it, each value the report uses checked: ``{"checkpoint",
    "train_seq_len", "config", "results"}`` (``results``: the rows; the fields the tables read are checked).

    Raises:
        FileNotFoundError: there is no such file.
        JsonFileError: it is not a regular file, not JSON, or a value does not have the eval's type or range (one
            line naming the file and the field).
    """
    fields = Fields(read_json(path), str(path))
    rows = []
    for i, row in enumerate(fields.sequence("results")):
        checked = _ROWS[task](Fields(row, str(path), f"results[{i}]."))
        rows.append({**row, **checked})  # the fields no table reads ride along unchecked (the demo merges them)
    return {
        "checkpoint": _optional(fields, "checkpoint", fields.string),
        "train_seq_len": _optional(fields, "train_seq_len", fields.integer, low=1),
        "config": fields.mapping("config", default={}),
        "results": rows,
    }


def _passkey_sample(record: Fields) -> dict:
    return {
        "length": record.integer("length", low=1),
        "depth": record.number("depth", low=0, high=1),
        "key": record.string("key"),
        "answer": _text_or_ids(record, "answer_text", "answer"),
        "predicted": _text_or_ids(record, "predicted_text", "predicted"),
        "right": record.sequence("predicted") == record.sequence("answer"),
    }


def _ruler_sample(record: Fields) -> dict:
    task = record.string("task", choices=RULER_TASKS)
    answers = record.sequence("answers")
    if not all(isinstance(a, str) for a in answers):
        raise JsonFileError(f"{record.where}: field 'answers' must be a list of strings")
    return {
        "task": task,
        "length": record.integer("length", low=1),
        "answers": ", ".join(answers),
        "prediction": record.string("prediction"),
        "score": record.number(RULER_TASKS[task].metric, low=0, high=1),
    }


def _text_or_ids(record: Fields, text_key: str, ids_key: str) -> str:
    """The decoded text of a sample's ids, or (a file written before the text was kept) the ids themselves."""
    if text_key in record.obj:
        return json.dumps(record.string(text_key), ensure_ascii=False)
    ids = record.sequence(ids_key)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise JsonFileError(f"{record.where}: field '{ids_key}' must be a list of token ids")
    return f"ids {ids}"


def read_samples(path: Path, task: str) -> list[dict]:
    """The finished samples of ``<task>.samples.jsonl`` (after its settings line), each as the examples table shows
    it. A last line without its newline was cut by a kill (the eval reruns that sample) and is left out.

    Raises:
        FileNotFoundError: there is no such file.
        JsonFileError: it is not a regular file, or a line is not a sample the eval writes (naming file and line).
    """
    try:
        raw = read_regular(path.parent, path.name, max_size=DEFAULT_MAX_BYTES)
    except UnsafeDatasetError as err:
        raise JsonFileError(str(err)) from None
    lines = raw[: raw.rfind(b"\n") + 1].splitlines()
    read = _passkey_sample if task == "passkey" else _ruler_sample
    return [read(Fields(parse_json(line, f"{path}:{i}"), f"{path}:{i}")) for i, line in enumerate(lines[1:], start=2)]


# ---------------------------------------------------------------- the tables (shared with make demo)


def pool_passkey(rows: Iterable[dict]) -> list[dict]:
    """Passkey rows (any number of depths and files) pooled per length, weighted by their samples: ``{"length",
    "accuracy", "exact_match", "n", "seconds"}`` and ``needle_fetched``, the share of (sample, retrieval group)
    pairs whose question's retrieval held the asked needle, where samples recorded it."""
    pooled: dict[int, dict[str, float]] = {}
    for r in rows:
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
    return [
        {
            "length": length,
            "accuracy": p["hits"] / p["n"],
            "exact_match": p["exact"] / p["n"],
            "n": int(p["n"]),
            "seconds": round(p["seconds"], 1),
            **({"needle_fetched": p["fetched"] / p["asked"]} if p["asked"] else {}),
        }
        for length, p in sorted(pooled.items())
    ]


def _grid(rows: list[dict], models: list[str], cell: Callable[[dict], str]) -> list[str]:
    """A table with a row per model and a column per length; ``cell(row)`` of the row of each, ``–`` where none."""
    lengths = sorted({r["length"] for r in rows})
    by = {(r["model"], r["length"]): r for r in rows}
    lines = ["| model | " + " | ".join(short_length(n) for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for model in models:
        cells = ["–" if (r := by.get((model, n))) is None else cell(r) for n in lengths]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def passkey_table(rows: list[dict], models: list[str]) -> str:
    """Pooled passkey rows (``pool_passkey``, with ``model``): first-token accuracy (exact match, samples)."""
    return "\n".join(
        _grid(rows, models, lambda r: f"{100 * r['accuracy']:.0f}% ({100 * r['exact_match']:.0f}%, n={r['n']})")
    )


def passkey_time_table(rows: list[dict], models: list[str]) -> str:
    """Seconds per passkey sample (building, streaming and decoding), by model and length."""
    return "\n".join(_grid(rows, models, lambda r: f"{r['seconds'] / r['n']:.1f} s" if r.get("seconds") else "–"))


def needle_fetched_table(rows: list[dict], models: list[str]) -> list[str]:
    """How often the question's retrieval held the asked needle (``retrieval.g<i>.asked_needle``), by model and
    length: a wrong answer with the needle fetched is a copy error, without it a retrieval error. No lines when no
    sample recorded it (a model without retrieval)."""
    fetched = [r for r in rows if "needle_fetched" in r]
    if not fetched:
        return []
    shown = [m for m in models if any(r["model"] == m for r in fetched)]
    return [
        "How often the question's retrieval held the asked needle (every retrieval group counted): a miss is a "
        "retrieval error; an answer wrong although the needle was fetched, a copy error.",
        "",
        *_grid(fetched, shown, lambda r: f"{100 * r['needle_fetched']:.0f}%"),
        "",
    ]


def ppl_table(rows: list[dict], models: list[str], source: str, whole: str) -> list[str]:
    """The caption and table of ``--task ppl`` rows (with ``model``): a column per context length and one of the
    whole-document pass. ``source``: what the scored sequences are (``windows of the validation split``);
    ``whole``: the last column's heading (``whole windows``)."""
    context = [r for r in rows if r["kind"] == "context"]
    if not context:
        return []
    lengths = sorted({r["length"] for r in context})
    cell = {(r["model"], r.get("length")): f"{r['ppl']:.2f}" for r in rows}
    first = context[0]
    lines = [
        f"Perplexity of the same final {first['tokens'] // max(first['documents'], 1)} tokens of "
        f"{first['documents']} {source}, with each length of context; the last column streams each of them whole.",
        "",
        "| model | " + " | ".join(short_length(n) for n in lengths) + f" | {whole} |",
        "|---" * (len(lengths) + 2) + "|",
    ]
    for model in models:
        cells = [cell.get((model, n), "–") for n in [*lengths, None]]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def far_recall_table(rows: list[dict], models: list[str]) -> list[str]:
    """Far recall of the ppl rows that measured it (GCA models): the learned retriever, random picks and the
    recency rule, each with the count of tokens it is a fraction of (docs/evaluation.md, far recall)."""
    measured = [r for r in rows if r["kind"] == "context" and "far_recall_tokens" in r]
    if not measured:
        return []

    def cell(r: dict) -> str:
        rates = [r[k] for k in ("far_recall", "far_recall_random", "far_recall_nearest")]
        shown = " / ".join("–" if v is None else f"{v:.3f}" for v in rates)
        return f"{shown} (n={r['far_recall_tokens']})"

    return [
        "Far recall of the scored tokens: retriever / random picks / nearest chunks beyond the windows, over the n "
        "tokens with a far occurrence.",
        "",
        *_grid(measured, [m for m in models if any(r["model"] == m for r in measured)], cell),
        "",
    ]


def ruler_section(rows: list[dict], models: list[str]) -> list[str]:
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
            lines += [f"**{model}**", "", tables(mine)]
    return lines


# ---------------------------------------------------------------- the report of eval directories


def _cell(text: str, limit: int | None = MAX_TEXT) -> str:
    """``text`` safe in a markdown table cell: cut to ``limit`` characters, ``|`` and markup escaped."""
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for char in "\\`*_[]|#":
        text = text.replace(char, "\\" + char)
    return text


def _first_of_each(samples: list[dict], key: Callable[[dict], Any]) -> list[dict]:
    """The first sample of each ``key`` in sorted order, at most ``MAX_EXAMPLES``."""
    first: dict[Any, dict] = {}
    for s in samples:
        first.setdefault(key(s), s)
    return [first[k] for k in sorted(first)][:MAX_EXAMPLES]


def _examples(directory: Path, task: str) -> list[str]:
    """A few predictions of ``<directory>/<task>.samples.jsonl`` with their decoded text; no lines without it."""
    name = PASSKEY_SAMPLES if task == "passkey" else RULER_SAMPLES
    try:
        samples = read_samples(directory / name, task)
    except FileNotFoundError:
        return []
    if not samples:
        return []
    if task == "passkey":
        shown = _first_of_each(samples, lambda s: s["length"])
        head = ["| length | depth | key | answer | predicted | right |", "|---:|---:|---|---|---|---|"]
        body = [
            f"| {short_length(s['length'])} | {s['depth']:.2f} | {_cell(s['key'])} | {_cell(s['answer'])} | "
            f"{_cell(s['predicted'])} | {'yes' if s['right'] else 'no'} |"
            for s in shown
        ]
    else:
        shown = _first_of_each(samples, lambda s: (s["task"], s["length"]))
        head = ["| task | length | answers | prediction | score |", "|---|---:|---|---|---:|"]
        body = [
            f"| {s['task']} | {short_length(s['length'])} | {_cell(s['answers'])} | "
            f"{_cell(json.dumps(s['prediction'], ensure_ascii=False))} | {s['score']:.2f} |"
            for s in shown
        ]
    return [
        f"Predictions in `{directory / name}` ({len(shown)} of {len(samples)} samples: the first of each "
        f"{'length' if task == 'passkey' else 'task and length'}; text as the export's tokenizer decodes it):",
        "",
        *head,
        *body,
        "",
    ]


def _plot(directory: Path, task: str, report: Path) -> list[str]:
    """A link to ``<directory>/<task>.png`` relative to the report, or a line saying it is missing."""
    png = directory / f"{task}.png"
    if not png.is_file():
        return [f"({png} is missing: no plot.)", ""]
    return [f"![{task}: {directory}]({Path(os.path.relpath(png, report.parent)).as_posix()})", ""]


def _ppl_source(config: dict) -> tuple[str, str]:
    """What ``--task ppl`` scored, from its recorded config: (``documents of data=...``, ``whole documents``)."""
    unit = "windows" if config.get("ppl_documents") == "windows" else "documents"
    data = config.get("data")
    return f"{unit} of data={_cell(data, limit=None) if isinstance(data, str) else '?'}", f"whole {unit}"


def write_report(directories: list[Path], out: Path) -> str:
    """Read the eval outputs in ``directories``, write the report to ``out`` (``data_prep.safe_write``: never
    through a link) and return it.

    Raises:
        ReportError: a directory does not exist or holds none of the tasks' results.
        JsonFileError: a result or samples file is unreadable or not what the eval writes (naming it).
        UnsafeWriteError: ``out`` is a link or not a regular file.
    """
    found: dict[str, dict[str, dict]] = {task: {} for task in TASKS}  # task -> directory label -> result
    labels = {d: str(d) for d in directories}
    for directory in directories:
        if not directory.is_dir():
            raise ReportError(f"{directory}: no such directory (pass the --out of launch/eval.py)")
        for task in TASKS:
            try:
                found[task][labels[directory]] = read_result(directory / f"{task}.json", task)
            except FileNotFoundError:
                continue
        if not any(labels[directory] in by for by in found.values()):
            raise ReportError(
                f"{directory}: holds none of {', '.join(f'{t}.json' for t in TASKS)}; pass the --out of launch/eval.py"
            )
    models = list(labels.values())
    lines = ["# Evaluation report", "", f"Made by `launch/report.py {' '.join(models)}`", ""]
    lines += ["| directory | checkpoint | training length | results | absent |", "|---|---|---|---|---|"]
    for label in labels.values():
        mine = {task: by[label] for task, by in found.items() if label in by}
        first = next(iter(mine.values()))
        checkpoint, trained = _cell(first["checkpoint"] or "–", limit=None), first["train_seq_len"] or "–"
        held = ", ".join(f"{t}.json" for t in mine)
        absent = ", ".join(f"{t}.json" for t in TASKS if t not in mine) or "–"
        lines.append(f"| {label} | {checkpoint} | {trained} | {held} | {absent} |")
    lines.append("")
    for task, title in (("ppl", "Perplexity"), ("passkey", "Passkey"), ("ruler", "RULER")):
        by = found[task]
        lines += [f"## {title}", ""]
        if not by:
            lines += [f"No directory holds {task}.json (`launch/eval.py --task {task} ...`).", ""]
            continue
        rows = [{"model": label, **r} for label, result in by.items() for r in result["results"]]
        shown = [m for m in models if m in by]
        if task == "ppl":
            source, whole = _ppl_source(next(iter(by.values()))["config"])
            lines += [*ppl_table(rows, shown, source, whole), *far_recall_table(rows, shown)]
        elif task == "passkey":
            pooled = [{"model": label, **r} for label, result in by.items() for r in pool_passkey(result["results"])]
            lines += [
                "Passkey retrieval, accuracy of the first answer token (all answer tokens and the samples in "
                "brackets), all depths pooled; the plots show each depth.",
                "",
                passkey_table(pooled, shown),
                "",
                "Seconds per sample (building it, streaming the prefix, decoding the answer).",
                "",
                passkey_time_table(pooled, shown),
                "",
                *needle_fetched_table(pooled, shown),
            ]
        else:
            lines += ruler_section(rows, shown)
        for directory, label in labels.items():
            if label in by:
                lines += _plot(directory, task, out)
                if task != "ppl":
                    lines += _examples(directory, task)
    report = "\n".join(lines).rstrip("\n") + "\n"
    write_text(out, report)
    return report

"""RULER-style long-context suite (``--task ruler``; docs/evaluation.md): RULER's synthetic task families, each
sample built by the trainer's own builder (``pipeline.data.retrieval_tasks.build_task``), streamed like passkey.

``RULER_TASKS`` names each task as lm-eval's ``ruler`` group does and gives it RULER's counts and kinds (4 keys,
4 values, 4 queries, one chain of 4 hops, 10 common words, 3 frequent words, UUID values, haystacks made of
needles). The texts are the project's own (the ones the trainer's retrieval mix writes), not RULER's wording. A
sample of ``length`` tokens is a haystack window of the run's ``data`` (``niah_single_1``: always RULER's noise
text, ``haystack.NOISE``) with the task written over it; the needle depth is drawn per sample, as RULER draws it.
Every sample is seeded by (seed, length, the task's place in ``RULER_TASKS``, sample), so a run of fewer tasks or
lengths gets the same samples.

Prediction: the input stops right before the answer and the model decodes as many tokens greedily as the
reference answer has (``passkey.predict_answer``: streamed, chunk memory on disk past ``offload_mb``). Scores are
RULER's, on the decoded text after ``postprocess``, with ``refs`` the sample's answers (the asked values, names or
words): ``string_match_all`` = (references found in the prediction, case-insensitive substring) / (references);
``string_match_part`` = 1 if any reference is found, else 0; each row holds their means over its samples, and as
``score`` the task's own RULER metric (``RulerTask.metric``: ``string_match_part`` for QA, whose references are
alternative answers; ``string_match_all`` for the rest).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from model import CausalLM
from pipeline.data.qa_task import build_qa, load_qa
from pipeline.data.retrieval_tasks import AGGREGATION_FAMILIES, Codec, TaskSample, TaskShape, default_spec
from pipeline.evaluation.answer_errors import ERROR_KINDS, TOKEN_KINDS, classify, copy_trace, summarize
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import build_sample, count_retrievals, predict_answer, retrieval_checks
from pipeline.evaluation.plots import short_length
from pipeline.evaluation.resume import SampleLog
from pipeline.evaluation.runtime import IN_RAM, StreamBudget
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer

log = logging.getLogger(__name__)

SAMPLES_FILE = "ruler.samples.jsonl"
SETTING_KEYS = ("data", "seed", "segment", "device", "attn_backend", "key_digits", "qa_squad", "qa_hotpot")
"""Eval keys a ruler sample's outcome depends on (``resume.SETTING_KEYS``' reasoning; ``ruler_tasks``, ``lengths``
and ``samples`` choose samples, each record names its own)."""


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: the family that builds it, its counts, whether its haystack is always the noise text, and
    for a QA task the format of the local file its questions come from (``pipeline.data.qa_task.QA_FORMATS``)."""

    family: str
    shape: TaskShape
    noise: bool = False
    qa: str | None = None

    @property
    def metric(self) -> str:
        """RULER's score for the task: every reference found, or (QA: references are alternatives) any one."""
        return "string_match_part" if self.qa else "string_match_all"


RULER_TASKS = {
    "niah_single_1": RulerTask("single", TaskShape(), noise=True),
    "niah_single_2": RulerTask("single", TaskShape()),
    "niah_multikey_1": RulerTask("multikey", TaskShape(needles=4)),
    "niah_multivalue": RulerTask("multivalue", TaskShape(values=4)),
    "niah_multiquery": RulerTask("multiquery", TaskShape(needles=4, queries=4)),
    "ruler_vt": RulerTask("vt", TaskShape(chains=1, hops=4)),
    "ruler_cwe": RulerTask("cwe", TaskShape(common_words=10, common_repeats=30, uncommon_repeats=3)),
    "ruler_fwe": RulerTask("fwe", TaskShape(frequent_words=3, zipf_alpha=2.0)),
    # Appended after the first eight, so that their places in this table, hence their samples, stay as they were.
    "niah_single_3": RulerTask("multikey", TaskShape(needles=1, queries=1, value_kind="uuid")),
    "niah_multikey_2": RulerTask("multikey", TaskShape(needle_haystack=True)),
    "niah_multikey_3": RulerTask("multikey", TaskShape(needle_haystack=True, name_kind="uuid", value_kind="uuid")),
    "ruler_qa_squad": RulerTask("qa", TaskShape(), qa="squad"),
    "ruler_qa_hotpot": RulerTask("qa", TaskShape(), qa="hotpot"),
}
"""The tasks ``--task ruler`` runs, in report order (new tasks go at the end: a task's place seeds its samples).
``niah_single_3``: one needle of a made-up name and a UUID value in the data's text; ``niah_multikey_2``: a context
made only of name/number needles, one asked; ``niah_multikey_3``: the same with UUID names and values (all three
``multikey`` shapes the trainer's mix never draws); ``ruler_qa_squad`` / ``ruler_qa_hotpot``: questions and
documents of a local SQuAD / HotpotQA file (``pipeline.data.qa_task``), run only when named, with the file given."""
SYNTHETIC_TASKS = [name for name, task in RULER_TASKS.items() if task.qa is None]
"""The tasks that need no data file: what ``--task ruler`` and the demo run by default."""
HELD_OUT_FAMILIES = (*AGGREGATION_FAMILIES, "qa")
"""Families the trainer's mix never draws."""


@dataclass(frozen=True)
class RulerGrid:
    """What a ruler run asks: ``samples`` samples of each of ``tasks`` at each of ``lengths``."""

    tasks: list[str]
    lengths: list[int]
    samples: int
    seed: int
    key_digits: int = 5
    qa_files: dict[str, str] = field(default_factory=dict)
    """QA format (``squad``, ``hotpot``) -> the local file its tasks read."""


def sample_key(record: dict) -> tuple[str, int, int]:
    """Which sample a ``SampleLog`` record is: (task, length, sample)."""
    return (record["task"], record["length"], record["sample"])


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a prediction: control characters become newlines, outer whitespace goes."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def match_all(prediction: str, refs: tuple[str, ...] | list[str]) -> float:
    """RULER's ``string_match_all`` of one sample: the share of ``refs`` found (case-insensitive) in ``prediction``."""
    text = prediction.lower()
    return sum(ref.lower() in text for ref in refs) / len(refs)


def match_part(prediction: str, refs: tuple[str, ...] | list[str]) -> float:
    """RULER's ``string_match_part`` of one sample: 1 if any of ``refs`` is found in ``prediction``, else 0."""
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in refs))


def build_ruler_sample(
    name: str,
    sources: dict[str, TokenSource],
    tokenizer: ModelTokenizer | ByteTokenizer,
    *,
    length: int,
    rng: np.random.Generator,
    chunk_size: int,
    key_digits: int = 5,
    qa_files: dict[str, str] | None = None,
) -> TaskSample:
    """Task ``name``'s sample of ``length`` tokens over a window of ``sources["data"]`` (``sources["noise"]`` for
    a noise task), by ``passkey.build_sample`` (so by ``build_task``; QA tasks by ``qa_task.build_qa`` from their
    file in ``qa_files``), depth drawn from ``rng``.

    Raises:
        ValueError: ``length`` cannot hold the task (the message says why); a QA task's file is not given or cannot
            be read.
    """
    task = RULER_TASKS[name]
    source = sources["noise" if task.noise else "data"]
    if task.qa is not None:
        path = (qa_files or {}).get(task.qa)
        if path is None:
            raise ValueError(f"{name} reads its questions from a local file: set qa_{task.qa}=<file>")
        window = source.window(length, rng).astype(np.int64)
        return build_qa(
            load_qa(path, task.qa), window, Codec(tokenizer.encode, tokenizer.decode), rng, chunk_size=chunk_size
        )
    shape = replace(task.shape, key_digits=key_digits)
    spec = default_spec(task.family, shape)
    return build_sample(source, tokenizer, spec, length=length, depth=None, rng=rng, chunk_size=chunk_size, shape=shape)


def sample_rng(grid: RulerGrid, name: str, length: int, sample: int) -> np.random.Generator:
    """The generator of one sample: seeded by (seed, length, the task's place in ``RULER_TASKS``, sample)."""
    return np.random.default_rng([grid.seed, length, list(RULER_TASKS).index(name), sample])


def check_grid(
    grid: RulerGrid, sources: dict[str, TokenSource], tokenizer: ModelTokenizer | ByteTokenizer, chunk_size: int
) -> None:
    """Build every task's first sample at the shortest length, and check that ``data`` holds the longest, before
    any evaluation.

    Raises:
        ValueError: a task does not fit the shortest length (naming both) or ``data`` is too short.
    """
    if not sources["data"].unbounded and any(RULER_TASKS[name].noise is False for name in grid.tasks):
        sources["data"].window(max(grid.lengths), np.random.default_rng(0))  # raises naming data and the length
    length = min(grid.lengths)
    for name in grid.tasks:
        try:
            build_ruler_sample(
                name,
                sources,
                tokenizer,
                length=length,
                rng=sample_rng(grid, name, length, 0),
                chunk_size=chunk_size,
                key_digits=grid.key_digits,
                qa_files=grid.qa_files,
            )
        except ValueError as err:
            raise ValueError(f"ruler_tasks: {name} at length {length}: {err}") from None


def evaluate_ruler(
    model: CausalLM,
    tokenizer: ModelTokenizer | ByteTokenizer,
    sources: dict[str, TokenSource],
    grid: RulerGrid,
    *,
    budget: StreamBudget = IN_RAM,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
    finished: SampleLog | None = None,
) -> list[dict]:
    """Rows ``{"task", "family", "held_out", "length", "string_match_all", "string_match_part", "metric", "score",
    "n", "seconds", "tokens_per_s"}`` per (task, length), lengths outermost. ``held_out``: the trainer's mix never
    draws the family. ``finished`` and ``progress`` as ``passkey.evaluate_passkey``'s."""
    rows = []
    for length in grid.lengths:
        keys = [(name, length, s) for name in grid.tasks for s in range(grid.samples)]
        todo = sum(finished is None or finished.get(key) is None for key in keys)
        if finished is not None and todo < len(keys):
            log.info(
                "ruler length=%d: %d of %d samples finished earlier (%s)",
                length,
                len(keys) - todo,
                len(keys),
                finished.path,
            )
        on_tokens = progress(length, todo * length) if progress and todo else None
        for name in grid.tasks:
            records = []
            for s in range(grid.samples):
                record = finished.get((name, length, s)) if finished else None
                if record is None:
                    record = _run_sample(model, tokenizer, sources, grid, (name, length, s), budget, on_tokens)
                    if finished is not None:
                        finished.add(record)
                records.append(record)
            seconds = sum(r["seconds"] for r in records)
            task = RULER_TASKS[name]
            means = {
                metric: round(sum(r[metric] for r in records) / len(records), 6)
                for metric in ("string_match_all", "string_match_part")
            }
            rows.append(
                {
                    "task": name,
                    "family": task.family,
                    "held_out": task.family in HELD_OUT_FAMILIES,
                    "length": length,
                    **means,
                    "metric": task.metric,
                    "score": means[task.metric],
                    "n": len(records),
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(len(records) * length / max(seconds, 1e-3), 1),
                    **({"retrieval": retrieval} if (retrieval := count_retrievals(records)) else {}),
                    **summarize(records),
                }
            )
            log.info("ruler %s length=%d: %s %.3f", name, length, task.metric, rows[-1]["score"])
    return rows


def _run_sample(
    model: CausalLM,
    tokenizer: ModelTokenizer | ByteTokenizer,
    sources: dict[str, TokenSource],
    grid: RulerGrid,
    at: tuple[str, int, int],
    budget: StreamBudget,
    on_tokens: Callable[[int], None] | None,
) -> dict:
    """Build sample ``at`` = (task, length, sample), predict and score it; the record ``SampleLog`` keeps."""
    name, length, s = at
    t0 = time.perf_counter()
    sample = build_ruler_sample(
        name,
        sources,
        tokenizer,
        length=length,
        rng=sample_rng(grid, name, length, s),
        chunk_size=model.cfg.chunk_size,
        key_digits=grid.key_digits,
        qa_files=grid.qa_files,
    )
    streamed = 0

    def count(tokens: int) -> None:
        nonlocal streamed
        streamed += tokens
        if on_tokens is not None:
            on_tokens(tokens)

    picks: dict[tuple[int, int], list[list[int]]] = {}
    predicted = predict_answer(model, sample, budget=budget, on_tokens=count, picks=picks)
    if on_tokens is not None:  # the haystack after the answer is never streamed: the progress counts length
        on_tokens(length - streamed)
    prediction = postprocess(tokenizer.decode(predicted))
    checks = retrieval_checks(sample, picks, model.cfg.chunk_size)
    record = {
        "task": name,
        "length": length,
        "sample": s,
        "answers": list(sample.answers),
        "predicted": predicted,  # the ids, beside their text as scored (decoded, then RULER's postprocess)
        "prediction": prediction,
        "string_match_all": match_all(prediction, sample.answers),
        "string_match_part": match_part(prediction, sample.answers),
        "seconds": round(time.perf_counter() - t0, 3),
        **({"retrieval": checks} if checks else {}),
        **_why_wrong(sample, checks, predicted, prediction, tokenizer),
    }
    log.info(
        "ruler %s length=%d sample %d: %.2f (answers %s, predicted %r)",
        name,
        length,
        s,
        record[RULER_TASKS[name].metric],
        sample.key,
        prediction,
    )
    return record


def _why_wrong(
    sample: TaskSample,
    checks: dict[str, dict[str, bool]],
    predicted: list[int],
    prediction: str,
    tokenizer: ModelTokenizer | ByteTokenizer,
) -> dict:
    """A needle sample's ``error`` (``answer_errors.classify``; absent when right) and, for a one-value answer, its
    ``copy`` trace (``answer_errors.copy_trace``)."""
    if not any("asked_needle" in group for group in checks.values()):
        return {}
    out: dict = {}
    if (error := classify(checks, prediction, sample.answers)) is not None:
        out["error"] = error
    if len(sample.answers) == 1:
        expected = sample.ids[sample.answer].tolist()
        out["copy"] = copy_trace(expected, predicted, tokenizer.decode)
    return out


def markdown_table(rows: list[dict], metric: str = "score") -> str:
    """``rows`` as a markdown table: a line per task (held-out ones marked), a column per length, ``metric`` x 100
    (``score``: each task's RULER metric), and a last line with the mean over the tasks at each length."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = {(r["task"], r["length"]): r[metric] for r in rows}
    lines = [
        "| task | " + " | ".join(short_length(n) for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for task in tasks:
        label = task + (" (held out)" if RULER_TASKS[task].family in HELD_OUT_FAMILIES else "")
        values = [f"{100 * cell[task, n]:.1f}" if (task, n) in cell else "-" for n in lengths]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    means = []
    for n in lengths:
        scores = [cell[t, n] for t in tasks if (t, n) in cell]
        means.append(f"{100 * sum(scores) / len(scores):.1f}" if scores else "-")
    lines.append("| **mean** | " + " | ".join(means) + " |")
    return "\n".join(lines) + "\n"


def errors_table(rows: list[dict]) -> str:
    """Why the needle tasks' wrong answers are wrong: a line per (task, length) with wrong samples, their count per
    ``answer_errors.ERROR_KINDS``, and for one-value answers the right tokens per kind after a correct prefix
    (``right/n``). Empty when no row has wrong needle answers."""
    wrong = [r for r in rows if r.get("errors")]
    if not wrong:
        return ""
    kinds = [k for k in TOKEN_KINDS if any(k in r.get("copy_by_kind", {}) for r in wrong)]
    lines = [
        "| task | length | wrong | " + " | ".join(ERROR_KINDS) + "".join(f" | {k} right" for k in kinds) + " |",
        "|---|---:|---:|" + "---:|" * (len(ERROR_KINDS) + len(kinds)),
    ]
    for r in wrong:
        counts = [str(r["errors"].get(kind, 0)) for kind in ERROR_KINDS]
        copy = r.get("copy_by_kind", {})
        tokens = [f"{copy[k]['right']}/{copy[k]['n']}" if k in copy else "-" for k in kinds]
        cells = [r["task"], short_length(r["length"]), f"{sum(r['errors'].values())}/{r['n']}", *counts, *tokens]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tables(rows: list[dict]) -> str:
    """The scores (``markdown_table``), then, when some needle answers are wrong, why (``errors_table``): what
    ``ruler.md`` holds and the reports show per model."""
    errors = errors_table(rows)
    return markdown_table(rows) + (
        f"\nWhy the wrong needle answers are wrong (docs/evaluation.md):\n\n{errors}" if errors else ""
    )

"""``launch/eval.py``: run one task on an export, write ``<out>/<task>.json`` and ``<out>/<task>.png`` (ruler also
``<out>/ruler.md``, the markdown table)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep.format import COMPLETE_MARKER, MANIFEST_FILENAME
from data_prep.redaction import redact_tree, restore_env_interpolations
from data_prep.safe_files import is_within
from data_prep.safe_write import UnsafeWriteError, check_names, write_text
from data_prep.schema import ConfigError
from kernels.cpu_math import flush_denormals
from pipeline.evaluation import ruler
from pipeline.evaluation.config import (
    TASKS,
    EvalConfig,
    load_eval_config,
    passkey_grid,
    result_config,
    ruler_grid,
    stream_budget,
    validate,
)
from pipeline.evaluation.footprint import check_footprint
from pipeline.evaluation.haystack import UNBOUNDED, TokenSource
from pipeline.evaluation.passkey import evaluate_passkey
from pipeline.evaluation.plots import plot_passkey, plot_ppl, plot_ruler
from pipeline.evaluation.ppl import context_ppl, document_ppl, too_short
from pipeline.evaluation.resume import SAMPLES_FILE, SETTING_KEYS, SampleLog, sample_settings
from pipeline.evaluation.runtime import Checkpoint, load_checkpoint

log = logging.getLogger(__name__)


class _Progress:
    """One tqdm bar (tokens, with tokens/s and the time left) per part of the evaluation; called as
    ``progress(length, total)`` for one evaluation length, ``progress(label, total)`` for a pass that is none
    (``whole documents``)."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.bar: tqdm | None = None

    def __call__(self, part: int | str, total: int) -> Callable[[int], None]:
        self.close()
        label = f"L={part}" if isinstance(part, int) else part
        bar = tqdm(total=total, desc=f"{self.task} {label}", unit="tok", unit_scale=True, dynamic_ncols=True)
        self.bar = bar

        def advance(tokens: int) -> None:
            bar.update(tokens)

        return advance

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class EvalOutputError(RuntimeError):
    """The eval finished but a result file could not be written where asked; the message says where the result
    went instead (``saved_to``; None: nowhere writable, ``result`` is all there is)."""

    def __init__(self, message: str, result: dict, saved_to: Path | None) -> None:
        super().__init__(message)
        self.result, self.saved_to = result, saved_to


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the evaluation; the message says what was kept for the rerun (the finished samples and their
    file, or that the task keeps none)."""


def run_eval(checkpoint: str, task: str, out: str | Path, overrides: list[str], config: str | None = None) -> dict:
    """Evaluate ``checkpoint`` on ``task``; returns the JSON written to ``<out>/<task>.json``.

    Every input (keys, ``--config``, ``--out``, the export) is checked before any evaluation runs.

    Raises:
        ConfigError: a bad key, value, config file or output location.
        FileNotFoundError / ValueError: the export is missing or malformed (named).
        EvalOutputError: the result could not be written to ``out`` (it was saved elsewhere, named).
        EvalInterrupted: Ctrl-C while the task ran.
    """
    flush_denormals()  # before torch starts its thread pool (see kernels/cpu_math.py)
    if task not in TASKS:
        raise ConfigError(f"--task {task!r} is not one of {TASKS}")
    cfg, env_paths = load_eval_config(config, overrides, task)
    check_footprint(checkpoint, task, cfg)
    out = Path(out)
    created = prepare_out(out, task, cfg.data)
    try:
        result = _evaluate(checkpoint, task, cfg, out)
    except BaseException:
        _remove_empty(created)  # a failed run leaves no empty directories behind
        raise
    result["config"] = restore_env_interpolations(result["config"], env_paths)
    result = redact_tree(result)
    json_path = write_result(result, out, task)
    title = f"{Path(checkpoint).resolve().parent.name}/{Path(checkpoint).name}"
    rows, train_seq_len = result["results"], result["train_seq_len"]
    if task == "ppl":
        plot = functools.partial(plot_ppl, rows, train_seq_len, f"perplexity: {title}")
    elif task == "ruler":
        heading = f"RULER (string_match_all; QA: string_match_part): {title}"
        plot = functools.partial(plot_ruler, rows, train_seq_len, heading)
        table = out / "ruler.md"
        try:
            write_text(table, ruler.tables(rows))
        except (OSError, UnsafeWriteError) as err:
            raise EvalOutputError(
                f"the result is in {json_path}, but {table} could not be written ({_why(err)})",
                result,
                json_path,
            ) from None
    else:
        plot = functools.partial(plot_passkey, rows, train_seq_len, f"passkey ({cfg.variant}): {title}")
    png = out / f"{task}.png"
    try:
        plot(png)
    except (OSError, UnsafeWriteError) as err:
        raise EvalOutputError(
            f"the result is in {json_path}, but {png} could not be written ({_why(err)})", result, json_path
        ) from None
    log.info("wrote %s and %s", json_path, png)
    return result


def _evaluate(checkpoint: str, task: str, cfg: EvalConfig, out: Path) -> dict:
    """Load the export, run the task, return the result (config still resolved). Passkey and ruler samples are
    kept in ``<out>/<task>.samples.jsonl`` as they finish; a rerun resumes from them
    (``pipeline.evaluation.resume``)."""
    ckpt = load_checkpoint(checkpoint, cfg.device, cfg.attn_backend)
    validate(cfg, ckpt.model.cfg.chunk_size, task)
    source = TokenSource(cfg.data, ckpt.tokenizer, cfg.seed)
    sources = {"data": source, "noise": TokenSource("noise", ckpt.tokenizer, cfg.seed)}
    if task == "ruler":
        try:
            ruler.check_grid(ruler_grid(cfg), sources, ckpt.tokenizer, ckpt.model.cfg.chunk_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    finished = None
    if task == "passkey":
        finished = SampleLog(out / SAMPLES_FILE, sample_settings(cfg, checkpoint, SETTING_KEYS), cfg.restart)
    elif task == "ruler":
        settings = sample_settings(cfg, checkpoint, ruler.SETTING_KEYS)
        finished = SampleLog(out / ruler.SAMPLES_FILE, settings, cfg.restart, key=ruler.sample_key)
    progress = _Progress(task) if cfg.progress else None
    t0 = time.perf_counter()
    try:
        rows = _run_task(task, cfg, ckpt, sources, progress, finished)
    except KeyboardInterrupt:
        if finished is None:
            raise EvalInterrupted(f"--task {task} keeps no partial results (a rerun starts over)") from None
        raise EvalInterrupted(f"{finished.kept()} finished samples are kept in {finished.path}") from None
    finally:
        if progress:
            progress.close()  # a line said after it starts on a line of its own
    return {
        "task": task,
        "checkpoint": str(checkpoint),
        "train_seq_len": ckpt.train_seq_len,
        "results": rows,
        "config": result_config(cfg, task),
        "seconds": round(time.perf_counter() - t0, 3),
        # ru_maxrss is KiB on Linux: the whole process's peak, model and Python included.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _run_task(
    task: str,
    cfg: EvalConfig,
    ckpt: Checkpoint,
    sources: dict[str, TokenSource],
    progress: _Progress | None,
    finished: SampleLog | None,
) -> list[dict]:
    """The result rows of ``task``, each finished sample of passkey and ruler added to ``finished``."""
    source = sources["data"]
    if task == "ppl":
        documents = ppl_documents(source, cfg)
        run = (ckpt.model, documents)
        budget = stream_budget(cfg)
        assert cfg.score_len is not None, "load_eval_config sets the default score_len"
        rows = context_ppl(*run, lengths=cfg.lengths, score_len=cfg.score_len, budget=budget, progress=progress)
        if cfg.document_ppl:
            unit = "windows" if cfg.ppl_documents == "windows" else "documents"
            rows.append(document_ppl(*run, budget=budget, progress=progress, unit=unit))
    elif task == "ruler":
        rows = ruler.evaluate_ruler(
            ckpt.model,
            ckpt.tokenizer,
            sources,
            ruler_grid(cfg),
            budget=stream_budget(cfg),
            progress=progress,
            finished=finished,
        )
    else:
        rows = evaluate_passkey(
            ckpt.model,
            ckpt.tokenizer,
            source,
            passkey_grid(cfg),
            budget=stream_budget(cfg),
            progress=progress,
            finished=finished,
        )
    return rows


def ppl_documents(source: TokenSource, cfg: EvalConfig) -> list[np.ndarray]:
    """The documents ``--task ppl`` scores: the first ``samples`` documents holding the longest length (reading
    no further), or the first ``samples`` windows of the longest length of the token stream (``ppl_documents``)."""
    need = max(cfg.lengths)
    if cfg.ppl_documents == "windows":
        windows = source.windows(need, cfg.samples)
        if not windows:
            raise ValueError(
                f"data={cfg.data} holds {len(source.prefix(need))} tokens, fewer than one window of the longest "
                f"length {need}; evaluate shorter lengths or use more data"
            )
        return windows
    chosen, longest = [], 0
    with contextlib.closing(source.documents(need)) as documents:
        for document in documents:
            longest = max(longest, len(document))
            if len(document) >= need:
                chosen.append(document)
            if len(chosen) == cfg.samples:
                break
    if not chosen:
        raise too_short(need, longest)
    return chosen


def _inside_data(out: Path, data: str) -> Path | None:
    """The dataset or ``data`` directory that ``out`` lies in, if any: results never go into input data (a text
    directory would even read them back as documents next time)."""
    where = out.resolve()
    for directory in (where, *where.parents):  # a prepared dataset holds both of its markers
        if (directory / COMPLETE_MARKER).exists() and (directory / MANIFEST_FILENAME).exists():
            return directory
    if data in (*UNBOUNDED, "stdlib"):
        return None
    for source in (Path(p).resolve() for p in data.split(",")):
        if source.is_dir() and is_within(out, source):
            return source
    return None


def prepare_out(out: Path, task: str, data: str) -> list[Path]:
    """Make sure ``out`` can take ``<task>.json`` and ``<task>.png`` before any work: create it and write a probe
    file. Returns the directories created (deepest last), to remove again if the run fails.

    Raises:
        ConfigError: ``out`` is a file, sits under a file, lies in a dataset or in ``data``, or cannot be
            created or written; a result path inside it is a directory.
    """
    inside = _inside_data(out, data)
    if inside is not None:
        raise ConfigError(
            f"--out {out}: lies inside the dataset or data directory {inside}; results are never "
            "written into input data, choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory; pass a directory (created if missing)")
    try:  # every name the task writes, so that a link planted at one is refused before the work, not after it
        check_names(
            out, [f"{task}.json", f"{task}.png", f"{task}.samples.jsonl", *(["ruler.md"] if task == "ruler" else [])]
        )
    except UnsafeWriteError as err:
        raise ConfigError(f"--out {out}: {err}") from None
    created = [p for p in (out, *out.parents) if not p.exists()][::-1]
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{task}.probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        _remove_empty(created)
        raise ConfigError(f"--out {out}: cannot write there ({_why(err)}); choose a writable directory") from None
    return created


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories ``prepare_out`` created, deepest first, as long as they are still empty."""
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:  # not empty (or already gone): it is no longer only ours
            return


def _why(err: Exception) -> object:
    """What went wrong with a write, in a few words: the system's reason, or the refusal's own line."""
    return getattr(err, "strerror", None) or err


def write_result(result: dict, out: Path, task: str) -> Path:
    """Write ``<out>/<task>.json``; if that fails, save it in the system temp dir and say where.

    Raises:
        EvalOutputError: ``out`` could not be written (the message names the file that holds the result).
    """
    text = json.dumps(result, indent=2) + "\n"
    path = out / f"{task}.json"
    try:
        out.mkdir(parents=True, exist_ok=True)  # it may have been removed while the eval ran
        write_text(path, text)
        return path
    except (OSError, UnsafeWriteError) as err:
        problem = f"could not write {path} ({_why(err)})"
    try:
        fd, rescue = tempfile.mkstemp(prefix=f"gca-eval-{task}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        raise EvalOutputError(
            f"{problem}, nor a file in the temp dir; the result is printed below", result, None
        ) from None
    raise EvalOutputError(f"{problem}; the finished result was saved to {rescue}", result, Path(rescue))

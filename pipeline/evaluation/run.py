"""``launch/eval.py``: run one task on an export, write ``<out>/<task>.json`` and ``<out>/<task>.png``."""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from kernels.cpu_math import flush_denormals
from pipeline.evaluation.config import TASKS, EvalConfig, EvalConfigError, load_eval_config, validate
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import NeedleSpec, evaluate_passkey
from pipeline.evaluation.plots import plot_passkey, plot_ppl
from pipeline.evaluation.ppl import evaluate_ppl
from pipeline.evaluation.runtime import load_checkpoint

log = logging.getLogger(__name__)


class _Progress:
    """One tqdm bar (tokens, with tokens/s) per evaluation length; called as ``progress(length, total)``."""

    def __init__(self, task: str) -> None:
        self.task, self.bar = task, None

    def __call__(self, length: int, total: int) -> Callable[[int], None]:
        self.close()
        self.bar = tqdm(total=total, desc=f"{self.task} L={length}", unit="tok", unit_scale=True, dynamic_ncols=True)
        return self.bar.update

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_eval(checkpoint: str, task: str, out: str | Path, overrides: list[str], config: str | None = None) -> dict:
    """Evaluate ``checkpoint`` on ``task``; returns the JSON written to ``<out>/<task>.json``."""
    flush_denormals()  # before torch starts its thread pool (see kernels/cpu_math.py)
    if task not in TASKS:
        raise EvalConfigError(f"--task {task!r} is not one of {TASKS}")
    cfg = load_eval_config(config, overrides)
    ckpt = load_checkpoint(checkpoint, cfg.device, cfg.attn_backend)
    validate(cfg, ckpt.model.cfg.chunk_size)
    source = TokenSource(cfg.data, ckpt.tokenizer, cfg.seed)
    progress = _Progress(task) if cfg.progress else None
    t0 = time.perf_counter()
    if task == "ppl":
        tokens = source.prefix(max(cfg.lengths) * cfg.samples)
        rows = evaluate_ppl(ckpt.model, tokens, cfg.lengths, cfg.samples, cfg.segment, cfg.offload_mb,
                            cfg.offload_dir, progress)
    else:
        spec = NeedleSpec(cfg.variant, cfg.needle, cfg.question, cfg.answer, cfg.link, cfg.needles, cfg.key_digits)
        rows = evaluate_passkey(ckpt.model, ckpt.tokenizer, source, spec, cfg.lengths, cfg.depths, cfg.samples,
                                cfg.seed, cfg.segment, ckpt.model.cfg.chunk_size, cfg.offload_mb, cfg.offload_dir,
                                progress)
    if progress:
        progress.close()
    result = {
        "task": task,
        "checkpoint": str(checkpoint),
        "train_seq_len": ckpt.train_seq_len,
        "results": rows,
        "config": asdict(cfg),
        "seconds": round(time.perf_counter() - t0, 3),
        # ru_maxrss is KiB on Linux: the whole process's peak, model and Python included.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{task}.json").write_text(json.dumps(result, indent=2) + "\n")
    title = f"{Path(checkpoint).resolve().parent.name}/{Path(checkpoint).name}"
    if task == "ppl":
        plot_ppl(rows, ckpt.train_seq_len, f"perplexity: {title}", out / "ppl.png")
    else:
        plot_passkey(rows, ckpt.train_seq_len, f"passkey ({cfg.variant}): {title}", out / "passkey.png")
    log.info("wrote %s and %s", out / f"{task}.json", out / f"{task}.png")
    return result

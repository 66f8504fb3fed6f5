"""The extrapolation monitor: how the model does at multiples of its training length, logged while it trains.

Every ``eval.extrapolation_every`` steps it runs two small probes at each length ``m x train.seq_len`` of
``eval.extrapolation_lengths``, shortest first, and adds their results to that step's metrics (so they land in
``metrics.jsonl`` and wandb with the step):

- ``extrap/passkey@<L>``: exact match (every answer token right) of a passkey hidden in ``L`` tokens of built-in
  filler prose (``pipeline.evaluation.passkey``), one sample per depth at ``eval.extrapolation_samples`` depths
  spread evenly over the haystack; the samples are the same at every step, so the values compare over the run.
  A run with a retrieval mix (``data.retrieval_mix``) probes each of its families the same way, with the mix's
  counts: ``extrap/passkey@<L>`` for ``single``, ``extrap/<family>@<L>`` for the others;
- ``extrap/ppl@<L>``: perplexity of the last ``score_len`` tokens of ``eval.extrapolation_samples`` windows of the
  validation split, with the ``L - score_len`` tokens before them as context (``pipeline.evaluation.ppl``); the
  windows and scored tokens are the same at every length, so only the context differs;
- ``extrap/skipped``: how many planned probes have no value this time: the budget ran out (the probe it ran out
  in is abandoned, never reported half-done) or the probe failed (a warning names the error).

A collapse of retrieval shows as ``passkey@16x`` falling while ``passkey@1x`` holds; a model that uses long
context keeps ``ppl@L`` falling (or flat) as ``L`` grows past the training length.

The plan is made at the first monitor step and logged: the passkey probe needs the dataset's tokenizer;
a perplexity length needs ``eval.extrapolation_samples`` windows of it in the validation split (longer lengths
are left out, and said so once). The probes of one step share ``eval.extrapolation_budget_s``, checked before each
probe and after every streamed segment inside it.

Distributed runs: every rank gathers the full weights (a collective under FSDP and ZeRO-3), rank 0 probes a plain
fp32 copy of the model in eval mode without moving the training RNG, and the other ranks wait for it in a barrier
here, after the hang watchdog has disarmed (the config refuses a budget above half the collective timeout). An
error in a probe is a warning: the monitor is advice, never a reason to stop the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model import CausalLM, build_model
from pipeline.data.needle import NeedleSpec
from pipeline.data.retrieval_tasks import FAMILIES
from pipeline.evaluation import ppl
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import PasskeyGrid, evaluate_passkey
from pipeline.evaluation.runtime import StreamBudget
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer
from pipeline.train import dist
from pipeline.train.callbacks.base import Callback
from pipeline.train.config import TrainConfig, mix_settings

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer

log = logging.getLogger(__name__)

SKIPPED = "extrap/skipped"


class _OverBudget(Exception):
    """The budget ran out inside a probe; raised from its per-segment progress callback to abandon it."""


@dataclass(frozen=True)
class Probe:
    kind: str
    """``passkey`` or ``ppl``."""
    length: int
    """Tokens: a multiple of the training length."""
    family: str = "single"
    """``passkey``: the retrieval task family (``pipeline.data.retrieval_tasks``)."""

    @property
    def name(self) -> str:
        label = self.family if self.kind == "passkey" and self.family != "single" else self.kind
        return f"{label}@{self.length}"


@dataclass
class ProbePlan:
    """What the monitor runs at each of its steps, fixed at its first one."""

    probes: list[Probe]
    tokenizer: ModelTokenizer | None
    haystack: TokenSource | None
    windows: list[np.ndarray]
    """Validation windows of the longest perplexity length (empty when no perplexity length fits)."""


@dataclass
class ProbeReport:
    values: dict[str, float]
    """Metric name -> value, for the probes that finished."""
    skipped: list[str]
    """Names of the planned probes without a value."""
    seconds: float


def spread_depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over the haystack, none at its very ends: ``(i + 0.5) / n``."""
    return [(i + 0.5) / n for i in range(n)]


class ExtrapolationMonitor(Callback):
    """Runs the probes every ``eval.extrapolation_every`` steps (see the module docstring). Registered before the
    metrics logger, which writes what it adds to the step's metrics.

    Args:
        clock: seconds, monotonic; the budget is measured with it (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.plan: ProbePlan | None = None

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if step % trainer.cfg.eval.extrapolation_every:
            return
        rank = trainer.info.rank
        weights = dist.guarded_collective(
            rank, f"step {step}: gathering the weights for the extrapolation monitor", trainer.engine.full_state_dict
        )
        if trainer.info.is_main:
            metrics.update(self.probe(trainer, weights, step))
        del weights
        dist.guarded_collective(rank, f"step {step}: waiting for rank 0's extrapolation monitor", dist.barrier)

    def probe(self, trainer: Trainer, weights: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """The metrics of one monitor step on rank 0; never raises an ``Exception``."""
        if self.plan is None:
            try:
                self.plan = make_plan(trainer)
            except Exception as err:
                log.warning("extrapolation monitor: off for this run, making its plan failed: %s", _one_line(err))
                self.plan = ProbePlan([], None, None, [])
        if not self.plan.probes:
            return {}
        with dist.isolated_rng(), torch.no_grad():  # the model's init and the probes must not move the training RNG
            try:
                model = eval_model(trainer, weights)
            except Exception as err:
                log.warning("step %d | extrapolation monitor: could not build the eval model: %s", step, _one_line(err))
                return {SKIPPED: len(self.plan.probes)}
            try:
                report = run_probes(model, self.plan, trainer, self.clock, step)
            finally:
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        shown = " ".join(f"{name.removeprefix('extrap/')}={value:.4g}" for name, value in report.values.items())
        log.info("step %d | extrapolation monitor (%.1f s): %s", step, report.seconds, shown or "no values")
        return {**report.values, SKIPPED: len(report.skipped)}


def make_plan(trainer: Trainer) -> ProbePlan:
    """The probes this run can do, shortest first, with the tokenizer, haystack and validation windows they read;
    what it cannot do is logged here, once."""
    cfg = trainer.cfg
    samples = cfg.eval.extrapolation_samples
    lengths = sorted(m * cfg.train.seq_len for m in cfg.eval.extrapolation_lengths)
    tokenizer = haystack = None
    if trainer.tokenizer is None:
        log.warning("extrapolation monitor: no tokenizer next to data.path, so no passkey probe")
    else:
        # from the bytes the trainer read safely: nothing planted at data.path in the meantime is read
        tokenizer = ModelTokenizer(trainer.tokenizer, f"{cfg.data.path}/{trainer.tokenizer.name}")
        if tokenizer.vocab_size > cfg.model.vocab_size:
            log.warning(
                "extrapolation monitor: the tokenizer has %d ids but model.vocab_size is %d, so no passkey probe",
                tokenizer.vocab_size,
                cfg.model.vocab_size,
            )
            tokenizer = None
        else:
            haystack = TokenSource("builtin", tokenizer, cfg.seed)
    windows = _validation_windows(trainer, tokenizer, lengths, samples)
    ppl_lengths = [n for n in lengths if windows and n <= len(windows[0])]
    families = probed_families(cfg) if tokenizer is not None else []
    probes = [
        probe
        for n in lengths
        for probe in (
            *(Probe("passkey", n, family) for family in families),
            *([Probe("ppl", n)] if n in ppl_lengths else []),
        )
    ]
    log.info("extrapolation monitor: probes %s", ", ".join(p.name for p in probes) or "none")
    return ProbePlan(probes, tokenizer, haystack, windows)


def probed_families(cfg: TrainConfig) -> list[str]:
    """The families the passkey probes read: the retrieval mix's own, or the single passkey without a mix."""
    mix = mix_settings(cfg.data)
    if mix.fraction == 0:
        return ["single"]
    return [family for family in FAMILIES if mix.families.get(family, 0) > 0]


def probe_spec(cfg: TrainConfig, family: str) -> NeedleSpec:
    """A passkey probe's sample definition: the family with the mix's counts, so the probe asks what the mix
    trains (the eval's multihop counts needles, two per chain)."""
    shape = mix_settings(cfg.data).shape
    needles = 2 * shape.chains if family == "multihop" else shape.needles
    return NeedleSpec(
        variant=family,
        needles=needles,
        values=shape.values,
        queries=shape.queries,
        hops=shape.hops,
        chains=shape.chains,
        value_kind=shape.value_kind,
    )


def _validation_windows(
    trainer: Trainer, tokenizer: ModelTokenizer | None, lengths: list[int], samples: int
) -> list[np.ndarray]:
    """``samples`` consecutive windows of the longest length that has that many in the validation stream
    (documents joined with EOS, as ``TokenSource`` joins them); the validation documents are short, so windows
    of the joined stream are what a long context can be scored on."""
    cfg = trainer.cfg
    split = str(Path(cfg.data.path) / cfg.data.val_split)
    try:
        # The split holds token ids; the tokenizer only supplies the EOS that joins its documents.
        source = TokenSource(split, tokenizer or ByteTokenizer())
        available = len(source.prefix(samples * lengths[-1]))
    except Exception as err:
        log.warning("extrapolation monitor: no perplexity probe, reading %s failed: %s", split, _one_line(err))
        return []
    fitting = [n for n in lengths if samples * n <= available]
    left_out = [n for n in lengths if n not in fitting]
    if left_out:
        log.warning(
            "extrapolation monitor: no perplexity at %s tokens: the validation split holds %d tokens, fewer than "
            "eval.extrapolation_samples=%d windows of them",
            ", ".join(map(str, left_out)),
            available,
            samples,
        )
    return source.windows(fitting[-1], samples) if fitting else []


def eval_model(trainer: Trainer, weights: dict[str, torch.Tensor]) -> CausalLM:
    """A plain fp32 copy of the trained model in eval mode on this rank's device (call inside ``isolated_rng``)."""
    model = build_model(trainer.cfg.model)
    model.load_state_dict(weights)
    return model.to(trainer.info.device).eval()


def run_probes(
    model: CausalLM, plan: ProbePlan, trainer: Trainer, clock: Callable[[], float], step: int
) -> ProbeReport:
    """Each planned probe in order, within ``eval.extrapolation_budget_s`` measured on ``clock``."""
    cfg = trainer.cfg
    budget = cfg.eval.extrapolation_budget_s
    start = clock()
    deadline = start + budget

    def progress(_length: int, _total: int) -> Callable[[int], None]:
        def after_segment(_tokens: int) -> None:
            if clock() > deadline:
                raise _OverBudget

        return after_segment

    values: dict[str, float] = {}
    skipped: list[str] = []
    spent_in: str | None = None
    for probe in plan.probes:
        if spent_in is None and clock() > deadline:
            spent_in = f"before {probe.name}"
        if spent_in is not None:
            skipped.append(probe.name)
            continue
        try:
            value = _run_probe(model, plan, probe, trainer, progress)
        except _OverBudget:
            spent_in = f"during {probe.name}"
            skipped.append(probe.name)
        except Exception as err:  # advice, not the run: say what failed and go on
            log.warning("step %d | extrapolation monitor: %s failed: %s", step, probe.name, _one_line(err))
            skipped.append(probe.name)
        else:
            values[f"extrap/{probe.name}"] = value
    if spent_in is not None:
        log.warning(
            "step %d | extrapolation monitor: eval.extrapolation_budget_s=%g ran out %s; skipped %s",
            step,
            budget,
            spent_in,
            ", ".join(skipped),
        )
    return ProbeReport(values, skipped, clock() - start)


def _run_probe(
    model: CausalLM,
    plan: ProbePlan,
    probe: Probe,
    trainer: Trainer,
    progress: Callable[[int, int], Callable[[int], None]],
) -> float:
    cfg = trainer.cfg
    segment = cfg.train.seq_len  # what the model was trained on; no backward pass, so it fits where training did
    if probe.kind == "passkey":
        assert plan.tokenizer is not None and plan.haystack is not None, "planned only with a tokenizer"
        depths = spread_depths(cfg.eval.extrapolation_samples)
        grid = PasskeyGrid(probe_spec(cfg, probe.family), [probe.length], depths, samples=1, seed=cfg.seed)
        rows = evaluate_passkey(
            model, plan.tokenizer, plan.haystack, grid, budget=StreamBudget(segment=segment), progress=progress
        )
        return sum(row["exact_match"] for row in rows) / len(rows)
    rows = ppl.context_ppl(
        model,
        plan.windows,
        lengths=[probe.length],
        score_len=cfg.extrapolation_score_len,
        budget=StreamBudget(segment=segment),
        progress=progress,
    )
    return float(rows[0]["ppl"])


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"

"""The extrapolation monitor: its steps, its values against independent evaluations, its budget, its errors."""

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.data.needle import NeedleSpec
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.passkey import PasskeyGrid, evaluate_passkey
from pipeline.evaluation.runtime import StreamBudget, load_checkpoint
from pipeline.train import dist
from pipeline.train.callbacks import extrapolation
from pipeline.train.callbacks.extrapolation import ExtrapolationMonitor, make_plan
from pipeline.train.config import ConfigError, load_config
from pipeline.train.trainer import Trainer, main

SEQ = 64  # train.seq_len of the tiny runs
MONITOR = {
    "eval.extrapolation_every": 2,
    "eval.extrapolation_lengths": "[1,4]",
    "eval.extrapolation_samples": 2,
    "eval.extrapolation_score_len": 24,
}
KEYS = ["extrap/passkey@64", "extrap/ppl@64", "extrap/passkey@256", "extrap/ppl@256"]


def reference_ppl(model, val_stream: np.ndarray, length: int, score_len: int, windows: int) -> float:
    """Brute force: one whole forward over the last ``length`` tokens of each window of the longest length
    (256), cross-entropy of the last ``score_len`` targets."""
    total, count = 0.0, 0
    for i in range(windows):
        window = torch.from_numpy(val_stream[i * 256 : (i + 1) * 256])
        ids = window[-length:][None]
        with torch.no_grad():
            logits = model(ids).logits[0, -score_len - 1 : -1].double()
        total += F.cross_entropy(logits, ids[0, -score_len:], reduction="sum").item()
        count += score_len
    return math.exp(total / count)


def reference_passkey(model, tokenizer, length: int) -> float:
    """The exact-match rate of one passkey sample at each of the depths 0.25 and 0.75 (seed 7, the runs' seed)."""
    grid = PasskeyGrid(NeedleSpec(), [length], [0.25, 0.75], samples=1, seed=7)
    rows = evaluate_passkey(model, tokenizer, TokenSource("builtin", tokenizer, 7), grid, budget=StreamBudget(SEQ))
    return sum(r["exact_match"] for r in rows) / 2


def test_logs_at_its_steps_the_values_of_an_independent_evaluation(tmp_path, tiny_data, overrides, metrics):
    run = tmp_path / "run"
    settings = {**MONITOR, "train.max_steps": 5, "checkpoint.every": 2, "checkpoint.keep_last": 5}
    assert main(None, overrides(run, tiny_data, **settings)) == 0
    logged = metrics(run)
    assert [s for s, m in logged.items() if any(k.startswith("extrap/") for k in m)] == [2, 4]
    for step in (2, 4):
        assert logged[step]["extrap/skipped"] == 0
        assert sorted(k for k in logged[step] if k.startswith("extrap/")) == sorted([*KEYS, "extrap/skipped"])
        ckpt = load_checkpoint(run / f"checkpoints/step_{step:08d}/export")
        val = TokenSource(str(tiny_data / "val"), ckpt.tokenizer).prefix(512)
        for length in (64, 256):
            want = reference_ppl(ckpt.model, val, length, 24, 2)
            assert logged[step][f"extrap/ppl@{length}"] == pytest.approx(want, rel=1e-4)
            assert logged[step][f"extrap/passkey@{length}"] == reference_passkey(ckpt.model, ckpt.tokenizer, length)
    # More context on the same scored tokens: the learnt chain is local, so a 4x longer context cannot hurt much.
    assert logged[4]["extrap/ppl@256"] < logged[4]["extrap/ppl@64"] * 1.1

    # The monitor leaves the run itself untouched: the same losses, bit for bit, as a run without it.
    plain = tmp_path / "plain"
    assert main(None, overrides(plain, tiny_data, **{"train.max_steps": 5, "checkpoint.export": False})) == 0
    assert [m["loss"].hex() for m in metrics(plain).values()] == [m["loss"].hex() for m in logged.values()]


class StepClock:
    """A fake clock that moves one second each time it is read (the monitor reads it once per probe and once per
    streamed segment)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def trainer(tmp_path, tiny_data, overrides):
    """A trainer at step 0 of a tiny run with the monitor on (its weights are the initial ones)."""

    def build(**settings: object) -> Trainer:
        cfg = load_config(None, overrides(tmp_path / "run", tiny_data, **{**MONITOR, **settings}))
        return Trainer(cfg, dist.init_distributed("none"))

    return build


def test_the_budget_cuts_probes_shortest_first_and_never_reports_a_partial_one(trainer, caplog):
    caplog.set_level(logging.INFO)
    full = trainer(**{"eval.extrapolation_budget_s": 1e6})
    weights = full.engine.full_state_dict()
    monitor = ExtrapolationMonitor(StepClock())
    everything = monitor.probe(full, weights, 2)
    assert everything["extrap/skipped"] == 0 and list(everything) == [*KEYS, "extrap/skipped"]
    reads = int(monitor.clock())

    finished_per_budget = []
    for budget in range(1, reads + 1):
        full.cfg.eval.extrapolation_budget_s = budget
        monitor.clock = StepClock()
        caplog.clear()
        got = monitor.probe(full, weights, 2)
        values = [k for k in got if k != "extrap/skipped"]
        assert values == KEYS[: len(values)], (budget, got)  # shortest first, and nothing after a cut
        assert all(got[k] == everything[k] for k in values), (budget, got)
        assert got["extrap/skipped"] == len(KEYS) - len(values)
        if len(values) < len(KEYS):
            assert f"eval.extrapolation_budget_s={budget} ran out" in caplog.text
        finished_per_budget.append(len(values))
    assert finished_per_budget == sorted(finished_per_budget)
    assert set(finished_per_budget) == set(range(len(KEYS) + 1))  # a cut after every probe and before all
    # The smallest budget starts the first probe and abandons it after its first segment.
    full.cfg.eval.extrapolation_budget_s = 1
    caplog.clear()
    assert ExtrapolationMonitor(StepClock()).probe(full, weights, 2) == {"extrap/skipped": len(KEYS)}
    assert "ran out during passkey@64" in caplog.text


def test_lengths_the_validation_split_cannot_hold_get_no_perplexity(trainer, caplog):
    # 2 windows of 20 x 64 = 1280 tokens need 2560; the split holds ~2300, so 256 is the longest perplexity.
    tr = trainer(**{"eval.extrapolation_lengths": "[20,1,4]"})
    plan = make_plan(tr)
    assert [p.name for p in plan.probes] == [
        "passkey@64",
        "ppl@64",
        "passkey@256",
        "ppl@256",
        "passkey@1280",
    ]
    assert [len(w) for w in plan.windows] == [256, 256]
    assert "no perplexity at 1280 tokens" in caplog.text


def test_a_failing_probe_is_a_warning_and_the_run_goes_on(tmp_path, tiny_data, overrides, metrics, caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(extrapolation, "evaluate_passkey", broken)
    run = tmp_path / "run"
    assert main(None, overrides(run, tiny_data, **MONITOR, **{"train.max_steps": 3, "checkpoint.export": False})) == 0
    logged = metrics(run)
    assert logged[2]["extrap/skipped"] == 2
    assert "extrap/passkey@64" not in logged[2] and logged[2]["extrap/ppl@256"] > 1
    assert "passkey@64 failed: RuntimeError: the probe broke" in caplog.text
    assert list(logged) == [1, 2, 3]


BASE = ["run_dir=/tmp/unused/run", "data.path=/tmp/unused/data", "train.seq_len=256"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.extrapolation_every=-1", "eval.extrapolation_every must be >= 0"),
        ("eval.extrapolation_lengths=[]", "eval.extrapolation_lengths must be a non-empty list of positive integers"),
        ("eval.extrapolation_lengths=[1,0]", "eval.extrapolation_lengths must be a non-empty list of positive"),
        ("eval.extrapolation_lengths=[1,16,1]", "eval.extrapolation_lengths must not repeat a length"),
        ("eval.extrapolation_lengths=[1.5]", "config key 'eval.extrapolation_lengths[0]' has a wrong value"),
        ("eval.extrapolation_samples=0", "eval.extrapolation_samples must be >= 1"),
        ("eval.extrapolation_score_len=256", "eval.extrapolation_score_len=256 must be >= 1 and shorter than"),
        ("eval.extrapolation_score_len=0", "eval.extrapolation_score_len=0 must be >= 1"),
        ("eval.extrapolation_budget_s=0", "eval.extrapolation_budget_s must be > 0"),
        ("eval.extrapolation_budget_s=nan", "eval.extrapolation_budget_s must be a finite number"),
        ("eval.extrapolation_evry=2", "did you mean 'eval.extrapolation_every'"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, override])
    assert message in str(err.value)


def test_score_len_defaults_to_half_the_training_length_at_most_1024():
    assert load_config(None, BASE).extrapolation_score_len == 128
    assert load_config(None, [*BASE, "train.seq_len=16380"]).extrapolation_score_len == 1024


def test_the_budget_must_leave_the_waiting_ranks_inside_the_collective_timeout(monkeypatch):
    monkeypatch.setenv(dist.TIMEOUT_ENV, "100")
    on = [*BASE, "eval.extrapolation_every=10", "train.global_batch=8"]
    with pytest.raises(ConfigError, match=r"eval.extrapolation_budget_s=60.0 must be at most half the collective"):
        load_config(None, [*on, "eval.extrapolation_budget_s=60"], world_size=2)
    assert load_config(None, [*on, "eval.extrapolation_budget_s=50"], world_size=2)
    assert load_config(None, [*on, "eval.extrapolation_budget_s=60"], world_size=1)  # nobody waits


@pytest.mark.dist
def test_two_ranks_gather_for_the_monitor_and_train_as_without_it(tmp_path, tiny_data, overrides, metrics, clean_shm):
    """FSDP2 over gloo: gathering the weights is a collective on every rank, rank 0 probes while rank 1 waits, and
    the losses are those of the same two-rank run without the monitor."""
    from test_pipeline_dist import launch

    runs = {}
    for name, extra in (("monitored", {**MONITOR, "train.max_steps": 4}), ("plain", {"train.max_steps": 4})):
        runs[name] = tmp_path / name
        proc = launch("fsdp", overrides(runs[name], tiny_data, **extra, **{"checkpoint.export": False}))
        assert proc.returncode == 0, proc.stderr[-4000:]
    monitored, plain = metrics(runs["monitored"]), metrics(runs["plain"])
    assert [s for s, m in monitored.items() if "extrap/skipped" in m] == [2, 4]
    assert all(monitored[s]["extrap/skipped"] == 0 and monitored[s]["extrap/ppl@256"] > 1 for s in (2, 4))
    assert [m["loss"].hex() for m in monitored.values()] == [m["loss"].hex() for m in plain.values()]


def test_a_run_with_a_retrieval_mix_probes_each_of_its_families(trainer, monkeypatch):
    """The passkey probes read the mix's families with the mix's counts; each value is that of an independent
    evaluation of the family's samples."""
    tr = trainer(**{"eval.extrapolation_lengths": "[4]", "eval.extrapolation_budget_s": 1e6})
    mix = tr.cfg.data.retrieval_mix  # set after construction: the tiny runs' 64 tokens hold no multivalue sample
    mix.fraction, mix.families, mix.values = 0.05, {"single": 1.0, "multivalue": 2.0}, 2
    plan = make_plan(tr)
    assert [p.name for p in plan.probes] == ["passkey@256", "multivalue@256", "ppl@256"]
    asked = []

    def recording(model, tokenizer, source, grid, **kwargs):
        asked.append(grid.spec)
        return evaluate_passkey(model, tokenizer, source, grid, **kwargs)

    monkeypatch.setattr(extrapolation, "evaluate_passkey", recording)
    got = ExtrapolationMonitor().probe(tr, tr.engine.full_state_dict(), 2)
    assert got["extrap/skipped"] == 0
    assert [(s.variant, s.values) for s in asked] == [("single", 2), ("multivalue", 2)]
    model = extrapolation.eval_model(tr, tr.engine.full_state_dict())
    spec = NeedleSpec("multivalue", values=2)
    grid = PasskeyGrid(spec, [256], [0.25, 0.75], samples=1, seed=7)
    rows = evaluate_passkey(
        model, plan.tokenizer, TokenSource("builtin", plan.tokenizer, 7), grid, budget=StreamBudget(SEQ)
    )
    assert got["extrap/multivalue@256"] == sum(r["exact_match"] for r in rows) / 2
    assert rows[0]["n"] == 1  # the probe really built and scored the family's samples


def test_the_probes_ask_for_the_value_kind_the_mix_trains(tmp_path):
    """With ``data.retrieval_mix.value_kind=uuid`` a probe's needle holds a UUID in the mix's uuid wording, as the
    mix's own samples do."""
    base = [f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.retrieval_mix.fraction=0.5"]
    mix = ["data.retrieval_mix.families={multikey: 1}", "data.retrieval_mix.value_kind=uuid"]
    spec = extrapolation.probe_spec(load_config(None, [*base, *mix]), "multikey")
    assert spec.value_kind == "uuid" and "special magic uuids for {name}" in spec.template("needle")
    plain = extrapolation.probe_spec(load_config(None, [*base, mix[0]]), "multikey")
    assert plain.value_kind == "number" and "special magic numbers for {name}" in plain.template("needle")

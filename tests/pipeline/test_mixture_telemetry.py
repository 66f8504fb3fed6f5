"""Per-source telemetry of a data mixture: each step's ``loss/<label>`` (the training forward's own per-sequence
losses, summed per source over the global batch) and per-source validation (``val/<label>/loss`` beside
``val_loss``), on real prepared datasets that differ in how learnable they are: two of the tests' Markov chain, one
of uniform random tokens, whose loss stays near ln(62) however long it trains."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import EOS, VOCAB, _tokenizer_bytes, prepared_dataset
from helpers import TINY_TRAIN_OVERRIDES, markov_pieces

from model.io import load_pretrained
from pipeline.data.reader import MDSReader, PackedSequences
from pipeline.train import dist
from pipeline.train.callbacks import PeriodicEval
from pipeline.train.config import load_config
from pipeline.train.export import EXPORT_DIR
from pipeline.train.inputs import check_inputs
from pipeline.train.trainer import Trainer, main

STEPS = 12
LOW = 2
"""Token ids of every dataset lie in ``[LOW, VOCAB)`` (0 and 1 are unk and EOS)."""


def _random_pieces(n_docs: int, seed: int):
    """Documents of independent uniform tokens: nothing to learn beyond the unigram, loss ln(VOCAB - LOW)."""
    rng = np.random.default_rng(seed)
    for doc in range(n_docs):
        tokens = rng.integers(LOW, VOCAB, int(rng.integers(40, 200)))
        for piece, part in enumerate(np.array_split(tokens, int(rng.integers(1, 3)))):
            yield doc, piece, part


SPLIT_ID = 34
"""`_short_and_long`: documents under 256 tokens hold ids ``[SPLIT_ID, VOCAB)``, longer ones ``[LOW, SPLIT_ID)``."""


def _short_and_long(n_docs: int, seed: int):
    """``n_docs`` documents of 40-199 uniform tokens and ``n_docs`` of 256-511, alternating, the two lengths over
    disjoint ids (`SPLIT_ID`): a sequence's ids say which length bucket its documents come from."""
    rng = np.random.default_rng(seed)
    for doc in range(2 * n_docs):
        low, high, lengths = (LOW, SPLIT_ID, (256, 512)) if doc % 2 else (SPLIT_ID, VOCAB, (40, 200))
        tokens = rng.integers(low, high, int(rng.integers(*lengths)))
        for piece, part in enumerate(np.array_split(tokens, int(rng.integers(1, 3)))):
            yield doc, piece, part


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three prepared datasets of one tokenizer: ``chain`` and ``chain2`` (the Markov chain, other documents) and
    ``noise`` (uniform tokens), each with a val split of its own kind; ``noval``: the chain without a val split;
    ``lengths``: `_short_and_long`, with the length histograms a bucket needs."""
    root, tok = tmp_path_factory.mktemp("telemetry"), _tokenizer_bytes()
    return {
        "chain": prepared_dataset(root / "chain", tok, markov_pieces(120, 11), markov_pieces(12, 12)),
        "chain2": prepared_dataset(root / "chain2", tok, markov_pieces(120, 21), markov_pieces(12, 22)),
        "noise": prepared_dataset(root / "noise", tok, _random_pieces(120, 31), _random_pieces(12, 32)),
        "noval": prepared_dataset(root / "noval", tok, markov_pieces(60, 41), None),
        "lengths": prepared_dataset(
            root / "lengths", tok, _short_and_long(60, 51), _short_and_long(8, 52), histograms=True
        ),
    }


def _run(run_dir: Path, mixture: dict[str, tuple[Path, float]], **extra: object) -> int:
    items = ", ".join(
        f"{{path: {path}, weight: {weight}, label: {label}, max_repeat: 50}}"
        for label, (path, weight) in mixture.items()
    )
    settings = {**TINY_TRAIN_OVERRIDES, "run_dir": run_dir, "train.max_steps": STEPS, **extra}
    return main(None, [*(f"{k}={v}" for k, v in settings.items()), f"data.sources=[{items}]"])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "loss" in r and "step" in r and "event" not in r]


def test_per_source_training_loss(tmp_path: Path, sources: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """Three sources, sequences of one length, no loss weights: every step logs ``loss/<label>`` for each source it
    drew from, their token-weighted mean (``share/<label>`` of equal sequences) is the logged ``loss``, and the
    noise source's loss stays near ln(62) while the chains' fall below it. The console line shows the per-source
    losses, not the per-source token counts and shares."""
    mixture = {"chain": (sources["chain"], 0.5), "chain2": (sources["chain2"], 0.25), "noise": (sources["noise"], 0.25)}
    with caplog.at_level(logging.INFO):
        assert _run(tmp_path / "run", mixture, **{"train.global_batch": 8, "train.micro_batch": 2}) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"step {STEPS} | loss=")]
    assert all(f" loss/{label}=" in line and f" epoch/{label}=" in line for label in mixture), line
    assert "tokens/" not in line and "share/" not in line, line
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        present = [label for label in mixture if r[f"share/{label}"] > 0]
        assert sorted(k for k in r if k.startswith("loss/")) == sorted(f"loss/{label}" for label in present)
        mean = sum(r[f"share/{label}"] * r[f"loss/{label}"] for label in present)
        assert mean == pytest.approx(r["loss"], rel=1e-5, abs=1e-6)
    late = {label: np.mean([r[f"loss/{label}"] for r in steps[-4:]]) for label in mixture}
    uniform = math.log(VOCAB - LOW)
    assert abs(late["noise"] - uniform) < 0.15, late
    assert late["chain"] < uniform - 0.3 and late["chain2"] < uniform - 0.3, late


def test_one_source_logs_no_source_keys(tmp_path: Path, sources: dict[str, Path]) -> None:
    """``data.path`` alone: no ``loss/``, ``share/``, ``tokens/`` or ``val/`` key in any record."""
    settings = {**TINY_TRAIN_OVERRIDES, "run_dir": tmp_path / "run", "data.path": sources["chain"]}
    settings.update({"train.max_steps": 3, "train.eval_every": 3, "train.eval_batches": 1})
    assert main(None, [f"{k}={v}" for k, v in settings.items()]) == 0
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records if r.get("event") == "eval"] == [3]
    for r in records:
        assert not [k for k in r if "/" in k and not k.startswith("retrieval/")], r


def _eval_events(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if r.get("event") == "eval"]


def _val_loss(export: Path, dataset: Path, batches: int) -> float:
    """The mean next-token loss of the exported model over the first ``batches`` global batches of ``dataset``'s
    val split, packed as validation packs it (file order, EOS between documents), computed here from the logits."""
    model = load_pretrained(export).eval()
    stream = PackedSequences(
        MDSReader(str(dataset), "val", cache_dir=None),
        seq_len=int(TINY_TRAIN_OVERRIDES["train.seq_len"]),
        seed=int(TINY_TRAIN_OVERRIDES["seed"]),
        shuffle=False,
        window=int(TINY_TRAIN_OVERRIDES["train.global_batch"]),
        eos_id=EOS,
    )
    x = torch.from_numpy(stream.next(batches * int(TINY_TRAIN_OVERRIDES["train.global_batch"]))[0])
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()).item()


def test_per_source_validation(tmp_path: Path, sources: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """Three text sources, one without a val split: one warning at the start names it, every evaluation reports
    ``val/<label>/loss`` of the other two, each what the exported model scores on that source's val sequences, and
    ``val_loss`` is their mean (the token mean: each gives ``train.eval_batches`` global batches)."""
    mixture = {"chain": (sources["chain"], 0.4), "noise": (sources["noise"], 0.4), "noval": (sources["noval"], 0.2)}
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        assert _run(run, mixture, **{"train.eval_every": 6, "train.eval_batches": 2}) == 0
    warned = [r.getMessage() for r in caplog.records if "left out of validation" in r.getMessage()]
    assert len(warned) == 1 and "data.sources[2] (noval)" in warned[0] and "has no validation split" in warned[0]
    events = _eval_events(run)
    assert [e["step"] for e in events] == [6, 12]
    for event in events:
        assert sorted(k for k in event if k.startswith("val/")) == ["val/chain/loss", "val/noise/loss"]
        assert event["val_loss"] == pytest.approx((event["val/chain/loss"] + event["val/noise/loss"]) / 2, rel=1e-6)
    last = events[-1]
    for label in ("chain", "noise"):
        expected = _val_loss(run / EXPORT_DIR, sources[label], batches=2)
        assert last[f"val/{label}/loss"] == pytest.approx(expected, rel=1e-5), label
    assert last["val/noise/loss"] > last["val/chain/loss"] + 0.3


def test_no_source_with_a_val_split_is_the_configuration_error(
    tmp_path: Path, sources: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    mixture = {"a": (sources["noval"], 0.5), "b": (sources["noval"], 0.5)}
    assert _run(tmp_path / "run", mixture, **{"train.eval_every": 2}) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no text source of data.sources has a validation split 'val'" in errors[0]
    assert "data.sources[0] (a)" in errors[0] and "data.sources[1] (b)" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_bucketed_source_is_validated_on_its_bucket(tmp_path: Path, sources: dict[str, Path]) -> None:
    """Two buckets of one dataset: each is validated on the val documents of its own bucket only (their ids tell),
    and reported under its own label."""
    items = (
        f"{{path: {sources['lengths']}, label: short, max_doc_tokens: 256, max_repeat: 50}}, "
        f"{{path: {sources['lengths']}, label: long, min_doc_tokens: 256, max_repeat: 50}}"
    )
    settings = {**TINY_TRAIN_OVERRIDES, "run_dir": tmp_path / "run", "train.eval_every": 2, "train.eval_batches": 2}
    cfg = load_config(None, [*(f"{k}={v}" for k, v in settings.items()), f"data.sources=[{items}]"])
    check_inputs(cfg)
    trainer = Trainer(cfg, dist.init_distributed("none"))
    evaluation = PeriodicEval(every=2)
    try:
        plan = evaluation._plan(trainer)
        assert plan is not None and [(s.label, s.bucket) for s in plan] == [("short", (0, 256)), ("long", (256, None))]
        for source, inside in zip(plan, (lambda t: t >= SPLIT_ID, lambda t: t < SPLIT_ID)):
            batches, error = evaluation._batches(trainer, source)
            assert error is None and len(batches) == 4  # 2 global batches of 2 micro-batches
            text = torch.cat(batches).flatten()
            text = text[text != EOS]
            assert inside(text).all(), source.label
        val_loss, logged = evaluation.evaluate(trainer)
    finally:
        evaluation.post_train(trainer)
    assert sorted(k for k in logged if k.startswith("val/")) == ["val/long/loss", "val/short/loss"]
    assert val_loss == pytest.approx((logged["val/long/loss"] + logged["val/short/loss"]) / 2, rel=1e-6)

"""``make demo-lm-gpu``: the paper's language-modelling claim on real books, in one time-boxed GPU command. It
lives beside ``make gpu-check`` because it runs on that check's stage runner (the demos group may not import it).

Whole books of the shipped Project Gutenberg shards are held out by a seeded rule before anything trains
(``pipeline.demos.books``); the rest become a tokenizer and MDS shards through data prep; ``gca`` (learned retriever),
``gca_random`` (``model.retrieval=random``, the paper's ablation) and ``swa`` (``model.arch=swa``, the same-depth
sliding-window model) train with one recipe for the same steps; each is scored on the same final tokens of every
held-out book with growing context (``--task ppl``, with far recall), then on needles at 64K and 256K. Every stage is
a subprocess under ``make gpu-check``'s runner (``pipeline.gpucheck.runner``): its own time box inside one budget,
skipped when what it needs did not finish, and ``demo-lm-gpu.json`` (+ ``results.md``, ``ppl.png``) rewritten after
each, so a run cut short keeps everything that finished.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.safe_write import write_text
from data_prep.schema import load_schema
from pipeline.demos.books import HELDOUT, INDEX, TRAIN
from pipeline.demos.demo_lm import MODEL_OVERRIDES as DEMO_LM_MODELS
from pipeline.demos.runner import eval_command
from pipeline.gpucheck.runner import Runner
from pipeline.gpucheck.stages import PREP_MODULE, TRAIN_MODULE, Plan, Stage, StageError, train_metrics

MODEL_OVERRIDES = {
    "gca": DEMO_LM_MODELS["gca"],
    "gca_random": DEMO_LM_MODELS["gca_random"],
    "swa": DEMO_LM_MODELS["baseline"],
}
"""What distinguishes the three models; everything else, the retrieval-task mix included, is the one train config."""
BOX_KEYS = ("books", "prep", "train", "ppl", "passkey", "ppl_long", "ruler")
RULER_TASK = "niah_single_2"
"""RULER's single needle in the data's own text (here: the held-out books)."""


@dataclass
class DemoLMGPUConfig:
    prep_config: str = "configs/demo_lm_gpu/prep.yaml"
    prep_overrides: list[str] = field(default_factory=list)
    """Extra ``key=value`` overrides of data prep (the dry run's tiny tokenizer)."""
    train_config: str = "configs/demo_lm_gpu/train.yaml"
    train_overrides: list[str] = field(default_factory=list)
    """Extra ``key=value`` overrides of every model's training (the dry run's tiny shapes)."""
    models: list[str] = field(default_factory=lambda: list(MODEL_OVERRIDES))
    seed: int = 0
    """Seeds the held-out draw and every evaluation."""
    holdout: int = 8
    """Held-out books drawn among those of at least ``holdout_min_bytes``."""
    holdout_min_bytes: int = 320_000
    holdout_long: int = 2
    """Held-out books drawn first, among those of at least ``holdout_long_min_bytes`` (the 256K-token evaluations)."""
    holdout_long_min_bytes: int = 1_200_000
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    """Context lengths of the perplexity stage, every held-out book long enough for the longest."""
    long_lengths: list[int] = field(default_factory=lambda: [262144])
    """Added to ``lengths`` in the ``ppl_long`` stages, on the held-out books long enough for them."""
    score_len: int = 512
    needle_lengths: list[int] = field(default_factory=lambda: [65536, 262144])
    needle_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    needle_samples: int = 1
    budget_s: float = 480.0
    """The whole run's budget after the wheels are installed; stages the rest cannot fit are skipped."""
    boxes: dict[str, float] = field(default_factory=dict)
    """Seconds each kind of stage may take at most (``BOX_KEYS``)."""
    expect: dict[str, float] = field(default_factory=dict)
    """Seconds each kind of stage is expected to take (the budget arithmetic; absent: 0). While a stage runs, the
    runner keeps the expected seconds of the later stages aside, so a hang costs its own share only."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODEL_OVERRIDES]
        if unknown or not self.models or len(set(self.models)) < len(self.models):
            raise ValueError(
                f"config key 'models' has a wrong value {self.models}: use some of {list(MODEL_OVERRIDES)}"
            )
        missing = [k for k in BOX_KEYS if self.boxes.get(k, 0) <= 0]
        stray = sorted(set(self.boxes) - set(BOX_KEYS))
        if missing or stray:
            raise ValueError(f"config key 'boxes' has a wrong value {self.boxes}: give each of {BOX_KEYS} seconds > 0")
        if set(self.expect) - set(BOX_KEYS) or any(not 0 <= v <= self.boxes[k] for k, v in self.expect.items()):
            raise ValueError(
                f"config key 'expect' has a wrong value {self.expect}: seconds from 0 to the box, per kind"
            )
        if not self.lengths or min(self.lengths) <= self.score_len or self.score_len < 1:
            raise ValueError(
                f"config keys 'lengths' {self.lengths} and 'score_len' {self.score_len}: every length must exceed "
                "score_len >= 1"
            )
        if any(n <= max(self.lengths) for n in self.long_lengths):
            raise ValueError(f"config key 'long_lengths' {self.long_lengths}: each must exceed max(lengths)")
        if self.holdout < 1 or self.holdout_long < 0 or self.budget_s <= 0 or self.needle_samples < 1:
            raise ValueError(
                "config keys 'holdout' (>= 1), 'holdout_long' (>= 0), 'budget_s' (> 0) and 'needle_samples' (>= 1) "
                f"are wrong: {self.holdout}, {self.holdout_long}, {self.budget_s}, {self.needle_samples}"
            )


def load_config(path: str | Path, overrides: list[str]) -> DemoLMGPUConfig:
    """The YAML merged with ``key=value`` overrides.

    Raises:
        ConfigError: one line naming the file or override, the key and the value.
    """
    return load_schema(DemoLMGPUConfig, path, overrides, what="demo-lm-gpu")[0]


@dataclass
class Paths:
    """Where a run writes below its work folder."""

    work: Path

    @property
    def holdout(self) -> Path:
        return self.work / "holdout.json"

    @property
    def books(self) -> Path:
        return self.work / "books"

    @property
    def heldout(self) -> Path:
        return self.books / HELDOUT

    @property
    def data(self) -> Path:
        return self.work / "data"

    def run(self, model: str) -> Path:
        return self.work / "runs" / model

    def export(self, model: str) -> Path:
        return self.run(model) / "export"

    def eval(self, model: str, stage: str) -> Path:
        return self.work / "eval" / model / stage


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise StageError(f"{path} was not written")
    return json.loads(path.read_text())


def books_stage(plan: Plan, cfg: DemoLMGPUConfig, books: Path) -> Stage:
    paths = Paths(plan.work)
    cmd = [plan.python, "-m", "pipeline.demos.books", "--books", str(books)]
    cmd += ["--holdout", str(paths.holdout), "--out", str(paths.books)]
    what = "unpack the book shards: the held-out books to books/heldout, the rest to books/train"

    def parse() -> dict:
        return _read_json(paths.books / INDEX)

    return Stage("books", what, cmd, cfg.boxes["books"], parse, expect_s=cfg.expect.get("books", 0.0))


def prep_stage(plan: Plan, cfg: DemoLMGPUConfig) -> Stage:
    paths = Paths(plan.work)
    cmd = [plan.python, "-m", PREP_MODULE, "--config", cfg.prep_config, f"input={paths.books / TRAIN}"]
    cmd += [f"output={paths.data}", f"num_proc={max(1, min(os.cpu_count() or 1, 16))}", *cfg.prep_overrides]

    def parse() -> dict:
        manifest = _read_json(paths.data / "manifest.json")
        splits = manifest.get("splits", {})
        numbers = {f"{split}_tokens": splits.get(split, {}).get("tokens") for split in ("train", "val")}
        numbers.update({f"{split}_documents": splits.get(split, {}).get("documents") for split in ("train", "val")})
        return numbers

    what = "the training books -> SentencePiece tokenizer -> MDS shards"
    return Stage("prep", what, cmd, cfg.boxes["prep"], parse, ("books",), expect_s=cfg.expect.get("prep", 0.0))


def train_stage(plan: Plan, cfg: DemoLMGPUConfig, model: str) -> Stage:
    paths = Paths(plan.work)
    run_dir = paths.run(model)
    cmd = [plan.python, "-m", TRAIN_MODULE, "--config", cfg.train_config, f"run_dir={run_dir}"]
    cmd += [f"data.path={paths.data}", *MODEL_OVERRIDES[model], *cfg.train_overrides]

    def parse() -> dict:
        numbers = train_metrics(run_dir)
        if not (paths.export(model) / "config.json").is_file():
            raise StageError(f"{paths.export(model)} holds no export")
        # The last logged step times the tokens of one step: right whatever logging.every is.
        numbers["tokens_trained"] = _metric_rows(run_dir)[-1]["step"] * numbers["tokens_per_step"]
        return numbers

    env = {} if plan.cuda else {"DS_ACCELERATOR": "cpu"}
    what = f"train {model} ({' '.join(MODEL_OVERRIDES[model]) or 'learned retriever'})"
    expect = cfg.expect.get("train", 0.0)
    return Stage(f"train-{model}", what, cmd, cfg.boxes["train"], parse, ("prep",), env, expect_s=expect)


def _metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and "step" in r]


def _device_keys(plan: Plan) -> list[str]:
    """On CUDA the chunk K/V of a 256K-token stream stays in host RAM (128 GiB there), not in a disk memmap."""
    return ["device=cuda", "offload_mb=-1"] if plan.cuda else ["device=cpu"]


def eval_stage(plan: Plan, cfg: DemoLMGPUConfig, model: str, kind: str) -> Stage:
    """``ppl`` / ``ppl_long`` (``--task ppl``), ``passkey`` or ``ruler`` of one model on the held-out books."""
    paths = Paths(plan.work)
    out = paths.eval(model, kind)
    keys = [f"data={paths.heldout}", f"seed={cfg.seed}", "progress=false", *_device_keys(plan)]
    books = cfg.holdout + cfg.holdout_long
    if kind in ("ppl", "ppl_long"):
        lengths = cfg.lengths + (cfg.long_lengths if kind == "ppl_long" else [])
        keys += [f"lengths={lengths}", f"score_len={cfg.score_len}", f"samples={books}", "document_ppl=false"]
        task, what = "ppl", f"{model}: ppl of the same final tokens of the held-out books at {lengths}"
    elif kind == "passkey":
        keys += [f"lengths={cfg.needle_lengths}", f"depths={cfg.needle_depths}", f"samples={cfg.needle_samples}"]
        task, what = "passkey", f"{model}: passkey in held-out book text at {cfg.needle_lengths}"
    else:
        keys += [f"ruler_tasks=[{RULER_TASK}]", f"lengths={cfg.needle_lengths}", f"samples={cfg.needle_samples}"]
        task, what = "ruler", f"{model}: RULER {RULER_TASK} in held-out book text at {cfg.needle_lengths}"
    cmd, env = eval_command(paths.export(model), task, out, keys)

    def parse() -> dict:
        result = _read_json(out / f"{task}.json")
        return {"rows": result["results"], "seconds": result["seconds"], "train_seq_len": result["train_seq_len"]}

    expect = cfg.expect.get(kind, 0.0)
    return Stage(f"{kind}-{model}", what, cmd, cfg.boxes[kind], parse, (f"train-{model}",), env, expect_s=expect)


def build_stages(plan: Plan, cfg: DemoLMGPUConfig, books: Path) -> list[Stage]:
    """Everything the claims need first (each model trained then scored 1K-64K, ``gca`` first and ``swa``, the
    model a GPU has run least, last); then the needles and 256K perplexity, which a short budget drops first."""
    stages = [books_stage(plan, cfg, books), prep_stage(plan, cfg)]
    for model in cfg.models:
        stages += [train_stage(plan, cfg, model), eval_stage(plan, cfg, model, "ppl")]
    for kind in ("passkey", "ppl_long", "ruler"):
        stages += [eval_stage(plan, cfg, model, kind) for model in cfg.models]
    return stages


class DemoRunner(Runner):
    """``make gpu-check``'s runner writing ``demo-lm-gpu.json`` whose ``summary`` holds the experiment's tables and
    claims, and ``results.md`` + ``ppl.png`` beside it, after every stage."""

    NAME = "demo-lm-gpu"

    def __init__(self, plan: Plan, out: Path, budget_s: float, experiment: dict) -> None:
        super().__init__(plan, out, budget_s)
        self.report["experiment"] = experiment

    def summarize(self) -> dict:
        from pipeline.demos.demo_lm_gpu_report import summarize

        experiment = self.report["experiment"]
        assert isinstance(experiment, dict), "set in __init__"
        return summarize(self.results, experiment)

    def write(self) -> None:
        from pipeline.demos.demo_lm_gpu_report import write_outputs

        super().write()
        write_outputs(self.report, self.out)


def run_experiment(plan: Plan, cfg: DemoLMGPUConfig, books: Path, out: Path, experiment: dict, budget_s: float) -> dict:
    """Write the held-out choice, then run every stage within ``budget_s``; returns the report also in
    ``out/demo-lm-gpu.json``."""
    paths = Paths(plan.work)
    paths.work.mkdir(parents=True, exist_ok=True)
    write_text(paths.holdout, json.dumps(experiment["holdout"], indent=2) + "\n")
    return DemoRunner(plan, out, budget_s, experiment).run(build_stages(plan, cfg, books))

"""``make demo-lm``: the language-modelling claims, measured on identical tokens.

GCA three ways -- plain language modelling (``gca``), with a 5% retrieval-task mix (``gca_mix``,
``data.retrieval_mix``) and with a random retriever (``gca_random``, the paper's ablation) -- its sliding-window
base (``model.arch=swa``) and a full-attention transformer (``model.arch=full``) are trained with one recipe
(``configs/demo_lm/train.yaml``: same width, depth, data, token budget and sequence length, except what
``model_overrides`` shortens) on the built-in corpus without a few held-out standard-library packages. Each
held-out package, its modules joined in path order, is one long evaluation document, and every model scores the
same final ``score_len`` tokens of every document with 1K, 4K, 16K, 64K tokens of context (``--task ppl``, with
the GCA models' far recall). The models of ``mix_eval_models`` answer the mix's task families over the held-out
text (``--task passkey variant=<family>``). Each model is trained then evaluated before the next one starts;
stages run as subprocesses a user could type and are skipped when their output exists (``pipeline.demos.runner``),
so an interrupted run continues.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from data_prep.builtin import corpus_files
from data_prep.format import COMPLETE_MARKER, read_manifest
from data_prep.redaction import restore_env_interpolations
from data_prep.safe_write import write_text
from data_prep.schema import load_schema
from pipeline.demos.runner import StageRunner, eval_command, train_command

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
PREP_MODULE = "data_prep.cli"
MODEL_OVERRIDES = {
    "gca": [],
    "gca_mix": ["data.retrieval_mix.fraction=0.05"],
    "gca_random": ["model.retrieval=random"],
    "gca_doc": ["model.retrieval_scope=document"],
    "baseline": ["model.arch=swa"],
    "full": ["model.arch=full"],
}
"""What distinguishes the demo's models; everything else comes from the one train config."""
MIX_FAMILIES = ["single", "multikey", "multivalue", "multiquery", "vt"]
"""The families of ``gca_mix``'s mix (the trainer's default set), each evaluated by ``mix_eval``."""
EVAL_DOCS = "eval_docs"
EVAL_DOCS_INDEX = "eval_docs.json"


@dataclass
class DemoLMConfig:
    run_dir: str = "runs/demo_lm"
    data: str = "data/demo_lm"
    """Where the training corpus (the built-in corpus minus ``holdout``) is prepared."""
    prep_config: str = "configs/data/demo_lm.yaml"
    train_config: str = "configs/demo_lm/train.yaml"
    ranks: int = 2
    """DeepSpeed ranks on this machine (CPU: one per core)."""
    models: list[str] = field(default_factory=lambda: ["gca", "gca_mix", "gca_random", "baseline", "full"])
    model_overrides: dict[str, list[str]] = field(default_factory=dict)
    """Extra ``key=value`` overrides of one model's training (``{full: [train.max_steps=90]}``: a shorter run)."""
    mix_eval_models: list[str] = field(default_factory=lambda: ["gca_mix", "gca"])
    """Models whose answers to the mix's task families are scored (``--task passkey variant=<family>``)."""
    mix_eval_lengths: list[int] = field(default_factory=lambda: [1024, 4096])
    mix_eval_samples: int = 2
    """Samples per (family, length, depth); five depths."""
    holdout: list[str] = field(default_factory=list)
    """Top-level standard-library packages held out of training; each becomes one evaluation document."""
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    """Context lengths (tokens, scored tokens included) of the perplexity evaluation."""
    score_len: int = 512
    """Tokens scored at the end of every document, the same ones at every length."""
    max_length: dict[str, int] = field(default_factory=dict)
    """The longest context length a model is evaluated at (``{full: 16384}``): full attention's cost grows with
    the square of the context, so 64K tokens of it take minutes per document on a CPU."""
    train_overrides: list[str] = field(default_factory=list)
    """Extra ``key=value`` overrides of every training run (e.g. a shorter smoke run)."""
    seed: int = 0

    def __post_init__(self) -> None:
        known = list(MODEL_OVERRIDES)
        unknown = [m for m in self.models if m not in MODEL_OVERRIDES]
        if unknown or not self.models:
            raise ValueError(f"config key 'models' has a wrong value {self.models}: use some of {known}")
        for key in ("model_overrides", "mix_eval_models"):  # naming a model not trained this time is harmless
            stray = sorted(set(getattr(self, key)) - set(MODEL_OVERRIDES))
            if stray:
                raise ValueError(f"config key '{key}' names unknown models {stray}: use some of {known}")
        if self.mix_eval_samples < 1 or not self.mix_eval_lengths:
            raise ValueError(
                "config keys 'mix_eval_samples' (>= 1) and 'mix_eval_lengths' (one length or more) are wrong"
            )
        if not self.holdout:
            raise ValueError("config key 'holdout' must name at least one standard-library package")
        if not self.lengths or any(n <= self.score_len for n in self.lengths):
            raise ValueError(
                f"config key 'lengths' has a wrong value {self.lengths}: each must exceed score_len={self.score_len}"
            )
        unknown = sorted(set(self.max_length) - set(MODEL_OVERRIDES))
        if unknown:
            raise ValueError(f"config key 'max_length' names unknown models {unknown}: use some of {known}")
        if any(cap < min(self.lengths) for cap in self.max_length.values()):
            raise ValueError(
                f"config key 'max_length' has a wrong value {self.max_length}: a model would be evaluated at no "
                f"length (the shortest is {min(self.lengths)})"
            )
        if self.score_len < 1:
            raise ValueError(f"config key 'score_len' has a wrong value {self.score_len}: must be >= 1")


def load_demo_lm_config(path: str | Path, overrides: list[str]) -> tuple[DemoLMConfig, dict[str, str]]:
    """The YAML merged with ``key=value`` overrides, and the dotted keys whose values read the environment.

    Raises:
        ConfigError: one line naming the file or override, the key and the value.
    """
    return load_schema(DemoLMConfig, path, overrides, what="demo-lm")


class DemoLMError(RuntimeError):
    """The demo cannot go on (a held-out package is missing or too short, a stage failed); the message says why."""


def holdout_files(packages: list[str]) -> dict[str, list[Path]]:
    """The sorted files of each held-out package of the built-in corpus, keyed by package.

    Raises:
        DemoLMError: a package has no file in the corpus (a typo, or another Python version's stdlib).
    """
    root, files = corpus_files("python_stdlib")
    by_package: dict[str, list[Path]] = {p: [] for p in packages}
    for path in files:
        parts = path.relative_to(root).parts
        if len(parts) > 1 and parts[0] in by_package:
            by_package[parts[0]].append(path)
    missing = [p for p, paths in by_package.items() if not paths]
    if missing:
        raise DemoLMError(f"holdout={packages}: {missing} hold no files of the standard library under {root}")
    return by_package


def write_eval_documents(packages: list[str], out_dir: Path, tokenizer_model: Path, min_tokens: int) -> list[dict]:
    """Write each held-out package as one document ``<out_dir>/<package>.txt`` (its modules in path order, each
    introduced by a ``# file: <path>`` line) and return ``[{"name", "files", "tokens"}]``.

    Raises:
        DemoLMError: a document holds fewer than ``min_tokens`` tokens (it could not be scored at every length).
    """
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    root, _ = corpus_files("python_stdlib")
    out_dir.mkdir(parents=True, exist_ok=True)
    index = []
    for package, paths in holdout_files(packages).items():
        parts = []
        for path in paths:
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(f"# file: {path.relative_to(root).as_posix()}\n{text.rstrip()}\n")
        document = "\n\n".join(parts)
        tokens = len(sp.encode(document))
        if tokens < min_tokens:
            raise DemoLMError(
                f"held-out package {package!r} is {tokens} tokens long, fewer than the longest context length "
                f"{min_tokens}: choose a larger package in 'holdout' or shorter 'lengths'"
            )
        write_text(out_dir / f"{package}.txt", document)
        index.append({"name": package, "files": len(paths), "tokens": tokens})
    return index


def check_earlier_outputs(holdout: list[str], data: Path, run_dir: Path) -> None:
    """Refuse a prepared corpus or evaluation documents that an earlier run made for other held-out packages: the
    stages would skip them as done, and a package evaluated now might then be in the training split.

    Raises:
        DemoLMError: naming the directory, what it was made for, and what to do.
    """
    if (data / COMPLETE_MARKER).is_file():
        excluded = read_manifest(data).config.get("exclude", [])
        if sorted(excluded) != sorted(exclude_patterns(holdout)):
            raise DemoLMError(
                f"{data} was prepared with exclude={excluded}, not for holdout={holdout}, so its training split may "
                "hold evaluation text: remove it, or set data=<another directory> to prepare one"
            )
    index = run_dir / EVAL_DOCS_INDEX
    if index.is_file():
        names = [document["name"] for document in json.loads(index.read_text())]
        if sorted(names) != sorted(holdout):
            raise DemoLMError(
                f"{run_dir} holds the evaluation documents (and models) of holdout={names}, not {holdout}: "
                "set run_dir=<a new directory>"
            )


def exclude_patterns(holdout: list[str]) -> list[str]:
    """Prep's ``exclude`` patterns that leave the held-out packages out of the corpus."""
    return [f"{package}/*" for package in holdout]


def train_model(stages: StageRunner, cfg: DemoLMConfig, model: str, run_dir: Path, data: Path) -> None:
    """Stage ``train-<model>``: the one recipe with the model's own overrides."""
    model_dir = run_dir / model
    overrides = [
        f"run_dir={model_dir}",
        f"data.path={data}",
        *MODEL_OVERRIDES[model],
        *cfg.train_overrides,
        *cfg.model_overrides.get(model, []),
    ]
    cmd, env = train_command(cfg.ranks, cfg.train_config, overrides)
    stages.run(f"train-{model}", cmd, model_dir / "export" / "model.safetensors", env)


def evaluate_model(stages: StageRunner, cfg: DemoLMConfig, model: str, run_dir: Path) -> None:
    """Stages ``ppl-<model>`` and, for the models of ``mix_eval_models``, ``mix-<model>-<family>``."""
    export = run_dir / model / "export"
    out = run_dir / "eval" / model
    lengths = [n for n in cfg.lengths if n <= cfg.max_length.get(model, n)]
    keys = [
        f"data={run_dir / EVAL_DOCS}",
        f"lengths={lengths}",
        f"score_len={cfg.score_len}",
        f"samples={len(cfg.holdout)}",
        f"seed={cfg.seed}",
        "document_ppl=false",  # whole documents of 80K-250K tokens would cost more than the rest together
    ]
    cmd, env = eval_command(export, "ppl", out, keys)
    stages.run(f"ppl-{model}", cmd, out / "ppl.json", env)
    if model not in cfg.mix_eval_models:
        return
    for family in MIX_FAMILIES:
        mix_out = run_dir / "eval" / model / "mix" / family
        keys = [
            f"data={run_dir / EVAL_DOCS}",  # the haystack is held-out real text, as the mix's is training text
            f"variant={family}",
            f"lengths={cfg.mix_eval_lengths}",
            f"samples={cfg.mix_eval_samples}",
            f"seed={cfg.seed}",
        ]
        cmd, env = eval_command(export, "passkey", mix_out, keys)
        stages.run(f"mix-{model}-{family}", cmd, mix_out / "passkey.json", env)


def run_demo_lm(config: str, overrides: list[str]) -> None:
    """Every stage not done yet, then ``ppl.json``, ``ppl.png`` and ``results.md`` in the run dir.

    Raises:
        ConfigError: the demo-lm config is wrong (nothing has run).
        DemoLMError: a held-out package is unusable, or a stage failed.
    """
    from pipeline.demos.demo_lm_report import write_demo_lm_report
    from pipeline.demos.runner import StageError

    cfg, env_paths = load_demo_lm_config(config, overrides)
    run_dir, data = ROOT / cfg.run_dir, ROOT / cfg.data
    holdout_files(cfg.holdout)  # a wrong package name fails before minutes of prep
    check_earlier_outputs(cfg.holdout, data, run_dir)
    stages = StageRunner(run_dir, ROOT)
    as_run = restore_env_interpolations(OmegaConf.to_container(OmegaConf.structured(cfg)), env_paths)
    write_text(run_dir / "demo_lm.yaml", OmegaConf.to_yaml(OmegaConf.create(as_run)))
    try:
        exclude = json.dumps(exclude_patterns(cfg.holdout))
        prep = [sys.executable, "-m", PREP_MODULE, "--config", cfg.prep_config, f"output={data}", f"exclude={exclude}"]
        stages.run("prep", prep, data / "_COMPLETE")
        index_path = run_dir / EVAL_DOCS_INDEX
        if not index_path.is_file():
            t0 = time.perf_counter()
            index = write_eval_documents(cfg.holdout, run_dir / EVAL_DOCS, data / "tokenizer.model", max(cfg.lengths))
            write_text(index_path, json.dumps(index, indent=2))
            stages.record("eval-documents", time.perf_counter() - t0)
        for model in cfg.models:  # each model trained and evaluated before the next: results arrive early
            train_model(stages, cfg, model, run_dir, data)
            evaluate_model(stages, cfg, model, run_dir)
    except StageError as err:
        raise DemoLMError(f"{err}; run the same command again to continue") from None
    sys.stdout.write(write_demo_lm_report(run_dir, cfg.models, stages.timings) + "\n")

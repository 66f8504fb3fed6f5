"""``make demo-cpt``: continued pretraining from a dense checkpoint, end to end on the built-in corpus.

A tiny dense ``transformers`` ``LlamaForCausalLM`` (built offline from a config, ``pipeline.demos.dense_llama``) is
trained on the corpus of ``make demo-lm`` (the standard library without the held-out packages, the same
tokenizer), converted into a GCA model by the trainer itself (``checkpoint.init_from=hf:<dense dir>``) and trained
on in two stages with the retrieval-task mix (each stage's keys: the config's ``stage1`` and ``stage2``; stage 2
starts from stage 1's export). The models are then compared on the same held-out tokens:

* ``dense``: the dense model, as a conversion whose sliding window spans the longest context it is evaluated at
  (``dense_max_length``): with hidden landmarks and a zero GCA output it computes the dense logits exactly (a
  stage checks this against ``transformers`` on one held-out document and records the difference), so the eval
  jobs score it like any export. Its cost grows with the square of the context, hence the cap.
* ``converted``: the GCA layout of ``train_config`` converted before any training (the window shrunk).
* ``stage1``, ``stage2``: after each training stage.

Every model gets perplexity by context (``--task ppl``, the last ``score_len`` tokens of each held-out document
with 512..64K of context) and the passkey (``--task passkey``, streamed with the chunk memory, 1K..1M; the dense
model up to ``dense_max_length``); the ``ruler_models`` also RULER's tasks (``--task ruler``). Stages are commands
a user could type, skipped when their output exists (``pipeline.demos.runner``), so an interrupted run continues.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from data_prep.redaction import restore_env_interpolations
from data_prep.safe_write import write_text
from data_prep.schema import ConfigError, load_schema
from pipeline.demos.demo_lm import (
    EVAL_DOCS,
    EVAL_DOCS_INDEX,
    PREP_MODULE,
    ROOT,
    check_earlier_outputs,
    exclude_patterns,
    holdout_files,
    write_eval_documents,
)
from pipeline.demos.runner import StageRunner, eval_command, train_command

log = logging.getLogger(__name__)

DENSE_MODULE = "pipeline.demos.dense_llama"
CONVERT_MODULE = "pipeline.cli.convert"
MODELS = ("dense", "converted", "stage1", "stage2")
"""What is evaluated, in the order it exists."""
LAYOUT_KEYS = ("n_lower_layers", "groups", "n_encoder_layers", "chunk_size", "top_k", "window")
"""The GCA layout keys ``train_config`` chooses; the conversions take them from there (one source)."""

DENSE_CHECK = "dense_check.json"


@dataclass
class DenseSpec:
    """The dense Llama and its training (``python -m pipeline.demos.dense_llama`` flags of the same names)."""

    steps: int = 200
    seq_len: int = 512
    batch: int = 16
    lr: float = 1.0e-3
    min_lr: float = 1.0e-4
    warmup: int = 20
    d_model: int = 128
    ffn_hidden: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2


@dataclass
class PasskeySlice:
    lengths: list[int] = field(default_factory=list)
    samples: int = 1
    models: list[str] = field(default_factory=list)
    """The models evaluated on this slice (empty: every one; the longest lengths cost minutes per model)."""


@dataclass
class DemoCPTConfig:
    run_dir: str = "runs/demo_cpt"
    data: str = "data/demo_lm"
    """The training corpus: the built-in corpus minus ``holdout`` (shared with ``make demo-lm``)."""
    prep_config: str = "configs/data/demo_lm.yaml"
    train_config: str = "configs/demo_cpt/train.yaml"
    ranks: int = 2
    dense: DenseSpec = field(default_factory=DenseSpec)
    stage1: list[str] = field(default_factory=list)
    """``key=value`` overrides of stage 1 (converted from the dense folder)."""
    stage2: list[str] | None = None
    """``key=value`` overrides of stage 2 (from stage 1's export); ``null``: no stage 2, stage 1's model is the
    final one."""
    train_overrides: list[str] = field(default_factory=list)
    """Overrides of both stages (a shorter smoke run)."""
    holdout: list[str] = field(default_factory=list)
    ppl_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    score_len: int = 512
    dense_max_length: int = 16384
    """The longest context the dense model is evaluated at (full attention: cost grows with its square)."""
    passkey: list[PasskeySlice] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: [0.25, 0.75])
    haystack: str = "stdlib"
    """The passkey haystack (``--task passkey data=``); stdlib holds ~10M tokens, enough for 1M."""
    check_tokens: int = 2048
    """Tokens of one held-out document on which the ``dense`` export is compared with ``transformers``."""
    ruler_lengths: list[int] = field(default_factory=list)
    """``--task ruler`` of the ``ruler_models`` at these lengths (empty: no RULER stage), on ``haystack``."""
    ruler_samples: int = 1
    """RULER samples per (task, length)."""
    ruler_tasks: list[str] = field(default_factory=list)
    """The RULER tasks (``pipeline.evaluation.ruler.RULER_TASKS``; empty: all of them)."""
    ruler_models: list[str] = field(default_factory=list)
    """The models RULER evaluates (empty: the final one)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.holdout:
            raise ValueError("config key 'holdout' must name at least one standard-library package")
        if self.score_len < 1 or not self.ppl_lengths or any(n <= self.score_len for n in self.ppl_lengths):
            raise ValueError(
                f"config key 'ppl_lengths' has a wrong value {self.ppl_lengths}: each must exceed "
                f"score_len={self.score_len} (>= 1)"
            )
        if self.dense_max_length < min(self.ppl_lengths):
            raise ValueError(
                f"config key 'dense_max_length' has a wrong value {self.dense_max_length}: the dense model would "
                f"be evaluated at no length (the shortest is {min(self.ppl_lengths)})"
            )
        if not self.passkey or any(not s.lengths or s.samples < 1 for s in self.passkey):
            raise ValueError("config key 'passkey' needs slices with lengths and samples >= 1")
        stray = sorted({m for s in self.passkey for m in s.models} - set(self.models))
        if stray:
            raise ValueError(f"config key 'passkey' names unknown models {stray}: use some of {list(self.models)}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"config key 'depths' has a wrong value {self.depths}: fractions in [0, 1]")
        if not 1 <= self.check_tokens <= self.dense_max_length:
            raise ValueError(f"config key 'check_tokens' has a wrong value {self.check_tokens}: 1 to dense_max_length")
        if self.ranks < 1:
            raise ValueError(f"config key 'ranks' has a wrong value {self.ranks}: must be >= 1")
        from pipeline.evaluation.ruler import RULER_TASKS

        unknown = sorted(set(self.ruler_tasks) - set(RULER_TASKS)) + sorted(set(self.ruler_models) - set(self.models))
        if unknown:
            raise ValueError(
                f"config key 'ruler_tasks' or 'ruler_models' has a wrong value: {unknown} are not among "
                f"{list(RULER_TASKS)} / {list(self.models)}"
            )
        if self.ruler_samples < 1:
            raise ValueError(f"config key 'ruler_samples' has a wrong value: {self.ruler_samples} must be >= 1")

    @property
    def models(self) -> tuple[str, ...]:
        """The models this demo makes: ``MODELS``, less ``stage2`` when there is no stage 2."""
        return MODELS if self.stage2 is not None else MODELS[:-1]

    @property
    def eval_order(self) -> tuple[str, ...]:
        """The final model's numbers first: an interrupted run has the headline comparison soonest."""
        final = self.models[-1]
        return (final, *(m for m in self.models if m != final))


def load_demo_cpt_config(path: str | Path, overrides: list[str]) -> tuple[DemoCPTConfig, dict[str, str]]:
    """The YAML merged with ``key=value`` overrides (and the keys reading the environment).

    Raises:
        ConfigError: one line naming the file or override, the key and the value.
    """
    return load_schema(DemoCPTConfig, path, overrides, what="demo-cpt")


class DemoCPTError(RuntimeError):
    """The demo cannot go on (a stage failed, an output is unusable); the message says why."""


def layout_overrides(train_config: Path, window: int | None = None) -> list[str]:
    """``model.<key>=<value>`` of the layout keys of ``train_config`` (``window`` replaced when given), for
    ``pipeline.cli.convert``.

    Raises:
        ConfigError: the train config lacks a layout key.
    """
    model = OmegaConf.to_container(OmegaConf.load(train_config)).get("model", {})  # type: ignore[union-attr]
    missing = [k for k in LAYOUT_KEYS if k not in model]
    if missing:
        raise ConfigError(f"{train_config}: model.{missing[0]} must be set (the conversions read the layout there)")
    values = {k: model[k] for k in LAYOUT_KEYS}
    if window is not None:
        values["window"] = window
    return [f"model.{k}={json.dumps(v)}" for k, v in values.items()]


def eval_lengths(model: str, cfg: DemoCPTConfig) -> tuple[list[int], list[PasskeySlice]]:
    """The ppl context lengths and passkey slices of ``model``: the dense model stops at ``dense_max_length``."""
    cap = cfg.dense_max_length if model == "dense" else None
    ppl = [n for n in cfg.ppl_lengths if cap is None or n <= cap]
    slices = [
        PasskeySlice([n for n in s.lengths if cap is None or n <= cap], s.samples, [model])
        for s in cfg.passkey
        if (not s.models or model in s.models) and any(cap is None or n <= cap for n in s.lengths)
    ]
    return ppl, slices


def dense_command(cfg: DemoCPTConfig, data: Path, out: Path) -> list[str]:
    spec = cfg.dense
    flags = {name: getattr(spec, name) for name in DenseSpec.__dataclass_fields__}
    cmd = [sys.executable, "-m", DENSE_MODULE, "--data", str(data), "--out", str(out), "--seed", str(cfg.seed)]
    for name, value in flags.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


def convert_command(dense: Path, out: Path, layout: list[str]) -> list[str]:
    return [sys.executable, "-m", CONVERT_MODULE, "--dense", str(dense), "--out", str(out), *layout]


def check_dense_export(dense: Path, export: Path, document: Path, tokens: int) -> dict:
    """Max |logit difference| between the ``transformers`` dense model and its ``dense`` export (streamed like the
    eval jobs stream) on the first ``tokens`` tokens of ``document``, with the logits' scale."""
    import sentencepiece as spm
    import torch
    from transformers import LlamaForCausalLM

    from model.io import load_pretrained

    sp = spm.SentencePieceProcessor(model_file=str(dense / "tokenizer.model"))
    ids = torch.tensor([sp.encode(document.read_text(encoding="utf-8"))[:tokens]])
    with torch.no_grad():
        reference = LlamaForCausalLM.from_pretrained(dense).eval()(input_ids=ids).logits.float()
        ours = load_pretrained(export).eval()
        got = ours.forward_stream(ids, ours.new_stream_state()).float()
    return {
        "tokens": int(ids.shape[1]),
        "max_abs_diff": float((got - reference).abs().max()),
        "max_abs_logit": float(reference.abs().max()),
    }


def run_demo_cpt(config: str, overrides: list[str]) -> None:
    """Every stage not done yet, then ``results.json`` and ``results.md`` in the run dir.

    Raises:
        ConfigError: the config is wrong (nothing has run).
        DemoCPTError: a stage failed.
    """
    from pipeline.demos.demo_cpt_report import write_demo_cpt_report
    from pipeline.demos.demo_lm import DemoLMError
    from pipeline.demos.runner import StageError

    cfg, env_paths = load_demo_cpt_config(config, overrides)
    run_dir, data = ROOT / cfg.run_dir, ROOT / cfg.data
    train_config = ROOT / cfg.train_config
    layout = layout_overrides(train_config)
    dense_layout = layout_overrides(train_config, window=cfg.dense_max_length)
    try:
        holdout_files(cfg.holdout)
        check_earlier_outputs(cfg.holdout, data, run_dir)
    except DemoLMError as err:
        raise DemoCPTError(str(err)) from None
    stages = StageRunner(run_dir, ROOT)
    as_run = restore_env_interpolations(OmegaConf.to_container(OmegaConf.structured(cfg)), env_paths)
    write_text(run_dir / "demo_cpt.yaml", OmegaConf.to_yaml(OmegaConf.create(as_run)))
    dense_dir = run_dir / "dense_hf"
    exports = {m: run_dir / m / "export" for m in MODELS}
    try:
        exclude = json.dumps(exclude_patterns(cfg.holdout))
        prep = [sys.executable, "-m", PREP_MODULE, "--config", cfg.prep_config, f"output={data}", f"exclude={exclude}"]
        stages.run("prep", prep, data / "_COMPLETE")
        index_path = run_dir / EVAL_DOCS_INDEX
        if not index_path.is_file():
            t0 = time.perf_counter()
            lengths = max(cfg.ppl_lengths)
            index = write_eval_documents(cfg.holdout, run_dir / EVAL_DOCS, data / "tokenizer.model", lengths)
            write_text(index_path, json.dumps(index, indent=2))
            stages.record("eval-documents", time.perf_counter() - t0)
        stages.run("train-dense", dense_command(cfg, data, dense_dir), dense_dir / "model.safetensors")
        stages.run(
            "convert-dense",
            convert_command(dense_dir, exports["dense"], dense_layout),
            exports["dense"] / "model.safetensors",
        )
        check_path = run_dir / DENSE_CHECK
        if not check_path.is_file():
            t0 = time.perf_counter()
            first = json.loads(index_path.read_text())[0]["name"]
            document = run_dir / EVAL_DOCS / f"{first}.txt"
            check = check_dense_export(dense_dir, exports["dense"], document, cfg.check_tokens)
            write_text(check_path, json.dumps(check, indent=2))
            stages.record("check-dense", time.perf_counter() - t0)
        stages.run(
            "convert",
            convert_command(dense_dir, exports["converted"], layout),
            exports["converted"] / "model.safetensors",
        )
        stages_to_train = [("stage1", f"hf:{dense_dir}", cfg.stage1)]
        if cfg.stage2 is not None:
            stages_to_train.append(("stage2", str(exports["stage1"]), cfg.stage2))
        for stage, init, extra in stages_to_train:
            keys = [f"run_dir={run_dir / stage}", f"data.path={data}", f"checkpoint.init_from={init}"]
            cmd, env = train_command(cfg.ranks, cfg.train_config, [*keys, *extra, *cfg.train_overrides])
            stages.run(f"train-{stage}", cmd, exports[stage] / "model.safetensors", env)
        for model in cfg.eval_order:
            evaluate(stages, cfg, model, run_dir)
    except StageError as err:
        raise DemoCPTError(f"{err}; run the same command again to continue") from None
    sys.stdout.write(write_demo_cpt_report(run_dir, stages.timings) + "\n")


def evaluate(stages: StageRunner, cfg: DemoCPTConfig, model: str, run_dir: Path) -> None:
    """Stages ``ppl-<model>``, ``passkey-<model>-<i>`` (one per passkey slice) and ``ruler-<model>``."""
    export = run_dir / model / "export"
    ppl_lengths, slices = eval_lengths(model, cfg)
    out = run_dir / "eval" / model
    keys = [
        f"data={run_dir / EVAL_DOCS}",
        f"lengths={ppl_lengths}",
        f"score_len={cfg.score_len}",
        f"samples={len(cfg.holdout)}",
        f"seed={cfg.seed}",
        "document_ppl=false",
    ]
    cmd, env = eval_command(export, "ppl", out / "ppl", keys)
    stages.run(f"ppl-{model}", cmd, out / "ppl" / "ppl.json", env)
    for i, piece in enumerate(slices):
        keys = [
            f"data={cfg.haystack}",
            f"lengths={piece.lengths}",
            f"samples={piece.samples}",
            f"depths={cfg.depths}",
            f"seed={cfg.seed}",
        ]
        slice_out = out / f"passkey_{i}"
        cmd, env = eval_command(export, "passkey", slice_out, keys)
        stages.run(f"passkey-{model}-{i}", cmd, slice_out / "passkey.json", env)
    if cfg.ruler_lengths and model in (cfg.ruler_models or [cfg.models[-1]]):
        keys = [
            f"lengths={cfg.ruler_lengths}",
            f"samples={cfg.ruler_samples}",
            f"seed={cfg.seed}",
            f"data={cfg.haystack}",
            *([f"ruler_tasks=[{','.join(cfg.ruler_tasks)}]"] if cfg.ruler_tasks else []),
        ]
        cmd, env = eval_command(export, "ruler", out / "ruler", keys)
        stages.run(f"ruler-{model}", cmd, out / "ruler" / "ruler.json", env)

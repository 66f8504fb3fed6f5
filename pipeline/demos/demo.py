"""``make demo``: prep -> DeepSpeed pretraining (2 CPU ranks) of a GCA model (``make demo-baseline`` adds a
sliding-window baseline) -> passkey, RULER-style and perplexity evaluation far beyond the training length -> one
results table.

Every stage is a subprocess running the same command a user could type (printed before it runs: the trainer and
the eval started by module name, ``deepspeed --module pipeline.cli.train`` and ``python -m pipeline.cli.eval``),
and every stage is skipped when its output is already complete, so an interrupted demo continues where it stopped.
Settings come from ``configs/demo/demo.yaml``; the training recipe from the train configs it names.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from data_prep.redaction import restore_env_interpolations
from data_prep.safe_write import write_text
from data_prep.schema import load_schema
from pipeline.demos.runner import StageError, StageRunner, eval_command, train_command

ROOT = Path(__file__).resolve().parents[2]
MULTIHOP_DIR = "multihop"
"""Where the two-hop part's models and evaluations go, under the demo's run_dir."""
# What distinguishes the demo's models; everything else comes from the same train config.
MODEL_OVERRIDES = {
    "gca": [],
    "baseline": ["model.arch=swa"],
    "ablation": ["model.retrieval_grad=false"],  # GCA whose retriever gets no gradient
    "gca_2groups": ["model.groups=[1,1]"],  # the same upper layers as two retrieval groups of one layer each
}


@dataclass
class EvalSlice:
    lengths: list[int]
    samples: int
    """Samples per (length, depth)."""
    models: list[str] | None = None
    """The models evaluated on this slice (default: all of them)."""
    haystack: str | None = None
    """The ``data`` of this slice (default: the demo's ``haystack``)."""


@dataclass
class RulerSlice:
    """One more ``--task ruler`` run after the main one (``ruler_lengths``): its own lengths, samples and tasks."""

    lengths: list[int]
    samples: int
    """Samples per (task, length)."""
    tasks: list[str] = field(default_factory=list)
    """The RULER tasks (empty: ``ruler_tasks``)."""


@dataclass
class TrainStage:
    name: str
    overrides: list[str] = field(default_factory=list)
    """``key=value`` overrides of this stage (sequence length, batch, steps, ...)."""


@dataclass
class MultihopDemo:
    """The two-hop part (``multihop.enabled=true``): models trained with the two-hop needle mix and evaluated with
    ``--task passkey variant=multihop``, under ``<run_dir>/multihop``; a section of ``results.md``."""

    enabled: bool = False
    only: bool = False
    """Run only the two-hop part (``make demo-multihop``): the main demo's stages are not run, and its results
    already on disk stay in ``results.md``."""
    models: list[str] = field(default_factory=lambda: ["gca_2groups", "gca"])
    """Two retrieval groups against the single-group control (same layers, same data, same steps)."""
    train_overrides: list[str] = field(default_factory=list)
    train_stages: list[TrainStage] = field(default_factory=list)
    """Its own curriculum (a two-hop sample needs more chunks than the main demo's first stage has; the needle
    variant is set per stage)."""
    passkey: list[EvalSlice] = field(default_factory=list)
    needles: int = 4
    """Needles per sample: the asked chain's link and key needle, and (needles - 2) / 2 distractor chains."""


@dataclass
class DemoConfig:
    run_dir: str = "runs/demo"
    data: str = "data/default"
    """A complete data-prep output (``make prep``)."""
    gca_config: str = "configs/demo/gca.yaml"
    """Train config of the GCA model; the baseline uses it with ``model.arch=swa`` (same data, steps, seed)."""
    ranks: int = 2
    """DeepSpeed ranks on this machine (CPU: one per core)."""
    train_overrides: list[str] = field(default_factory=list)
    """Extra ``key=value`` overrides for every training run (e.g. a shorter smoke run)."""
    train_stages: list[TrainStage] = field(default_factory=list)
    """A curriculum: each model trains through these stages in order, every stage starting from the previous
    stage's weights (``checkpoint.init_from``); empty = one stage with the train config as it is."""
    models: list[str] = field(default_factory=lambda: ["gca"])
    """The main demo's models (``MODEL_OVERRIDES``); ``make demo-baseline`` adds ``baseline``."""
    passkey: list[EvalSlice] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    haystack: str = "stdlib"
    ppl_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    ppl_samples: int = 4
    """Windows of the longest ppl length cut from the validation split (its documents are shorter)."""
    ppl_score_len: int = 512
    """The final tokens of each window scored at every ppl length (below the shortest)."""
    seed: int = 0
    longest: bool = False
    """Also run ``longest_passkey`` (``make demo-16m``): after the demo's own slices, so a finished demo's stages
    are reused and only the new evaluation runs."""
    longest_passkey: list[EvalSlice] = field(default_factory=list)
    multihop: MultihopDemo = field(default_factory=MultihopDemo)
    ruler_lengths: list[int] = field(default_factory=list)
    """``--task ruler`` of every model at these lengths (empty: no RULER stage), on ``haystack``."""
    ruler_samples: int = 1
    """RULER samples per (task, length)."""
    ruler_tasks: list[str] = field(default_factory=list)
    """The RULER tasks (``pipeline.evaluation.ruler.RULER_TASKS``; empty: all of them)."""
    ruler_slices: list[RulerSlice] = field(default_factory=list)
    """More RULER runs of every model after the main one, each into ``eval/<model>/ruler_<i>`` (``make
    demo-ruler``: the needle tasks at 1M with fewer samples); their rows join the main run's in ``ruler.json``."""
    seed_ruler: bool = False
    """The runs of ``seeds`` also run the RULER stages, and the report shows every task's spread over the seeds."""
    seeds: list[int] = field(default_factory=list)
    """More training seeds of the GCA model (``make demo-seeds``): each trains through ``train_stages`` with
    ``seed=<N>`` under ``<run_dir>/seeds/seed<N>`` and reads the ``passkey`` slices as the main run does, so the
    report shows the spread over seeds (the main run's seed included); empty: the main run only."""
    prose: str = ""
    """A haystack of English prose (a folder of text files, or any ``data`` of ``--task passkey``): with it, the GCA
    model of the main run and of every seed also reads the ``prose_passkey`` slices on it; empty: no prose rows.
    The demo ships no such text; ``make demo-seeds ARGS="prose=<folder of books>"``."""
    prose_passkey: list[EvalSlice] = field(default_factory=list)

    def __post_init__(self) -> None:
        named = [m for piece in [*self.passkey, *self.longest_passkey] for m in piece.models or []]
        unknown = [m for m in [*self.models, *self.multihop.models, *named] if m not in MODEL_OVERRIDES]
        if unknown:
            raise ValueError(
                f"config key 'models' has a wrong value: {unknown} are not among {sorted(MODEL_OVERRIDES)}"
            )
        from pipeline.evaluation.ruler import RULER_TASKS

        for key, tasks in (
            ("ruler_tasks", self.ruler_tasks),
            *((f"ruler_slices[{i}].tasks", piece.tasks) for i, piece in enumerate(self.ruler_slices)),
        ):
            unknown_tasks = [name for name in tasks if name not in RULER_TASKS]
            if unknown_tasks:
                raise ValueError(
                    f"config key '{key}' has a wrong value: {unknown_tasks} are not among {list(RULER_TASKS)}"
                )
        for i, piece in enumerate(self.ruler_slices):
            if piece.samples < 1 or not piece.lengths or min(piece.lengths) < 1:
                raise ValueError(
                    f"config key 'ruler_slices[{i}]' has a wrong value: lengths={piece.lengths} must be a non-empty "
                    f"list of positive lengths and samples={piece.samples} >= 1"
                )
        if self.seed_ruler and not (self.ruler_lengths or self.ruler_slices):
            raise ValueError("config key 'seed_ruler' needs a RULER stage (ruler_lengths or ruler_slices)")
        for key in ("seeds", "prose"):
            if getattr(self, key) and "gca" not in self.models:
                raise ValueError(f"config key '{key}' needs the gca model among models={self.models}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"config key 'seeds' has a wrong value: {self.seeds} repeats a seed")
        if self.ruler_samples < 1:
            raise ValueError(f"config key 'ruler_samples' has a wrong value: {self.ruler_samples} must be >= 1")
        if not self.ppl_lengths or not 1 <= self.ppl_score_len < min(self.ppl_lengths):
            raise ValueError(
                f"config key 'ppl_score_len' has a wrong value: {self.ppl_score_len} must be >= 1 and below the "
                f"shortest of ppl_lengths={self.ppl_lengths} (each length scores it after its context)"
            )


def load_demo_config(path: str | Path, overrides: list[str]) -> tuple[DemoConfig, dict[str, str]]:
    """The YAML merged with ``key=value`` overrides (``data_prep.schema.load_schema``), and the dotted keys of the
    values that read the environment.

    Raises:
        ConfigError: one line naming the file or override, the key and the value (environment values redacted).
    """
    return load_schema(DemoConfig, path, overrides, what="demo")


class DemoError(RuntimeError):
    """The demo cannot go on (no prepared data, a stage failed); the message says which and how to continue."""


class Stages:
    """The demo's commands, timed and skipped when already done (``pipeline.demos.runner``)."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.run_dir = ROOT / cfg.run_dir
        self.runner = StageRunner(self.run_dir, ROOT)

    def run(self, name: str, cmd: list[str], done: Path, env: dict[str, str]) -> None:
        try:
            self.runner.run(name, cmd, done, env)
        except StageError as err:
            raise DemoError(f"demo {err}") from None

    def train(
        self, model: str, stages: list[TrainStage] | None = None, part: str = "", extra: list[str] | None = None
    ) -> Path:
        """Train ``model`` through ``stages`` (default: the demo's curriculum) under ``<run_dir>/<part>``, with
        ``extra`` overrides after the demo's own; returns the last stage's export."""
        cfg = self.cfg
        stages = stages or cfg.train_stages or [TrainStage(name="train")]
        export: Path | None = None
        for stage in stages:
            run_dir = self.run_dir / part / model / stage.name
            overrides = [
                f"run_dir={run_dir}",
                f"data.path={ROOT / cfg.data}",
                *MODEL_OVERRIDES[model],
                *stage.overrides,
                *cfg.train_overrides,
                *(extra or []),
            ]
            if export is not None:
                overrides.append(f"checkpoint.init_from={export}")
            cmd, env = train_command(cfg.ranks, cfg.gca_config, overrides)
            export = run_dir / "export"
            name = "-".join(filter(None, ["train", part, model, stage.name]))
            self.run(name, cmd, export / "model.safetensors", env)
        assert export is not None
        return export

    def passkey(
        self, model: str, export: Path, slices: list[EvalSlice], part: str = "", extra: list[str] | None = None
    ) -> None:
        """``--task passkey`` of every slice into ``<run_dir>/<part>/eval/<model>/passkey_<i>``."""
        cfg = self.cfg
        for i, piece in enumerate(slices):
            if piece.models is not None and model not in piece.models:
                continue
            out = self.run_dir / part / "eval" / model / f"passkey_{i}"
            keys = [
                f"lengths={piece.lengths}",
                f"samples={piece.samples}",
                f"depths={cfg.depths}",
                f"seed={cfg.seed}",
                f"data={piece.haystack or cfg.haystack}",
                *(extra or []),
            ]
            cmd, env = eval_command(export, "passkey", out, keys)
            self.run("-".join(filter(None, ["passkey", part, model, str(i)])), cmd, out / "passkey.json", env)

    def evaluate(self, model: str, export: Path) -> None:
        cfg = self.cfg
        self.passkey(model, export, [*cfg.passkey, *(cfg.longest_passkey if cfg.longest else [])])
        out = self.run_dir / "eval" / model / "ppl"
        keys = [
            f"lengths={cfg.ppl_lengths}",
            f"samples={cfg.ppl_samples}",
            f"score_len={cfg.ppl_score_len}",
            "ppl_documents=windows",
            f"seed={cfg.seed}",
            f"data={ROOT / cfg.data}",
        ]
        cmd, env = eval_command(export, "ppl", out, keys)
        self.run(f"ppl-{model}", cmd, out / "ppl.json", env)
        self.ruler(model, export)

    def ruler(self, model: str, export: Path, part: str = "") -> None:
        """``--task ruler`` of the main slice (``ruler_lengths``) into ``<run_dir>/<part>/eval/<model>/ruler``, then
        of every ``ruler_slices`` entry into ``.../ruler_<i>``."""
        cfg = self.cfg
        runs = [("", piece) for piece in [RulerSlice(cfg.ruler_lengths, cfg.ruler_samples)] if cfg.ruler_lengths]
        runs += [(str(i), piece) for i, piece in enumerate(cfg.ruler_slices)]
        for index, piece in runs:
            out = self.run_dir / part / "eval" / model / "_".join(filter(None, ["ruler", index]))
            tasks = piece.tasks or cfg.ruler_tasks
            keys = [
                f"lengths={piece.lengths}",
                f"samples={piece.samples}",
                f"seed={cfg.seed}",
                f"data={cfg.haystack}",
                *([f"ruler_tasks=[{','.join(tasks)}]"] if tasks else []),
            ]
            cmd, env = eval_command(export, "ruler", out, keys)
            name = "-".join(filter(None, ["ruler", part, model, index]))
            self.run(name, cmd, out / "ruler.json", env)


SEEDS_DIR = "seeds"
"""Where the runs of ``seeds`` and the prose evaluations go, under the demo's run_dir."""


def run_seeds(stages: Stages, main_export: Path) -> dict[int, tuple[Path, Path]]:
    """Train and passkey-evaluate (with ``seed_ruler``, also RULER-evaluate) the GCA model once per extra seed,
    then read the prose slices with every seed's model (the main run's too). Returns ``{seed: (run directory,
    prose directory)}``, the main run's seed first, each directory holding ``eval/gca/passkey_<i>`` (and
    ``ruler*``) as the main run's holds its own."""
    cfg = stages.cfg
    main_seed = int(OmegaConf.load(main_export.parent / "config.yaml").seed)
    exports = {main_seed: main_export}
    runs = {main_seed: stages.run_dir}
    for seed in cfg.seeds:
        if seed != main_seed:
            part = f"{SEEDS_DIR}/seed{seed}"
            exports[seed] = stages.train("gca", part=part, extra=[f"seed={seed}"])
            stages.passkey("gca", exports[seed], cfg.passkey, part)
            if cfg.seed_ruler:
                stages.ruler("gca", exports[seed], part)
            runs[seed] = stages.run_dir / part
    prose = {seed: f"{SEEDS_DIR}/seed{seed}/prose" for seed in exports}
    if cfg.prose:
        slices = [EvalSlice(piece.lengths, piece.samples, haystack=cfg.prose) for piece in cfg.prose_passkey]
        for seed, export in exports.items():
            stages.passkey("gca", export, slices, prose[seed])
    return {seed: (run, stages.run_dir / prose[seed]) for seed, run in runs.items()}


def reported_models(cfg: DemoConfig, run_dir: Path) -> list[str]:
    """The models of ``results.md``: this run's, then any other main-demo model with evaluations already in
    ``run_dir`` (the baseline of an earlier ``make demo-baseline`` stays in the report of a later ``make demo``)."""
    earlier = [m for m in MODEL_OVERRIDES if m not in cfg.models and (run_dir / "eval" / m).is_dir()]
    return [*cfg.models, *earlier]


def run_demo(config: str, overrides: list[str]) -> None:
    """Every stage of the demo that is not done yet, then the results table (printed and written to the run dir).

    Raises:
        ConfigError: the demo config is wrong (nothing has run).
        DemoError: the data is not prepared, or a stage failed.
    """
    from pipeline.demos.demo_report import write_report

    cfg, env_paths = load_demo_config(config, overrides)
    if not (ROOT / cfg.data / "_COMPLETE").is_file():
        raise DemoError(f"{cfg.data} is not a complete data-prep output; run `make prep` first")
    if cfg.prose and cfg.prose not in ("builtin", "noise", "stdlib") and not (ROOT / cfg.prose).exists():
        raise DemoError(f"prose={cfg.prose}: no such file or folder (the evaluations read it from {ROOT})")
    stages = Stages(cfg)
    # The demo config as run (overrides applied); each training stage writes its own resolved config.yaml.
    as_run = restore_env_interpolations(OmegaConf.to_container(OmegaConf.structured(cfg)), env_paths)
    write_text(stages.run_dir / "demo.yaml", OmegaConf.to_yaml(OmegaConf.create(as_run)))
    hop = cfg.multihop
    main_runs = not (hop.enabled and hop.only)
    exports: dict[str, Path] = {}
    if main_runs:
        exports = {model: stages.train(model) for model in cfg.models}
        for model, export in exports.items():
            stages.evaluate(model, export)
    if hop.enabled:
        hop_exports = {
            model: stages.train(model, hop.train_stages, MULTIHOP_DIR, hop.train_overrides) for model in hop.models
        }
        for model, export in hop_exports.items():
            keys = ["variant=multihop", f"needles={hop.needles}"]
            stages.passkey(model, export, hop.passkey, MULTIHOP_DIR, keys)
    seed_runs = run_seeds(stages, exports["gca"]) if (cfg.seeds or cfg.prose) and main_runs else {}
    report = write_report(
        stages.run_dir,
        reported_models(cfg, stages.run_dir),
        stages.runner.timings,
        hop.models if hop.enabled else [],
        seed_runs,
    )
    sys.stdout.write(report + "\n")

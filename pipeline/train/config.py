"""``TrainConfig``: the one typed schema of a pretraining run, loaded from YAML plus ``key=value`` overrides.

Every field has a docstring under it. Loading goes through the shared loader (``data_prep.schema``: unknown keys
and wrong types are errors naming the full key, with a near-miss suggestion) -> a real dataclass tree ->
cross-field rules (``validate``), all before any process group, directory or file is created. Derived numbers (gradient
accumulation, tokens per step) are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import MISSING, DictConfig, OmegaConf

from data_prep import format as fmt
from data_prep import schema
from data_prep.redaction import restore_env_interpolations
from data_prep.safe_files import is_within
from data_prep.schema import load_schema
from model.config import GCAConfig
from model.context_parallel import check_cp_spans
from model.convert import PARAMETER_ROLES, ConversionError, check_fits, checkpoint_model_keys
from model.io import ExportError
from pipeline.data.reader import is_remote
from pipeline.data.retrieval_tasks import FAMILIES, TaskShape
from pipeline.evaluation.ppl import default_score_len
from pipeline.train.dist import TIMEOUT_ENV, collective_timeout_s

HF_INIT_PREFIX = "hf:"
"""``checkpoint.init_from=hf:<dir>`` converts a dense ``transformers`` checkpoint (``model/convert.py``)."""

_ENV_PATHS = "_env_interpolations"
"""Attribute of a loaded ``TrainConfig`` (outside its schema) holding `env_interpolations`."""


ConfigError = schema.ConfigError
"""The training configuration is invalid; the message names the full key and the rule (the one config error)."""


@dataclass
class TrainLoopConfig:
    max_steps: int = 100
    """Optimizer steps of the whole run; the LR schedule is pinned to it."""
    seq_len: int = 256
    """Raw tokens per training sequence (landmarks are added inside the model)."""
    micro_batch: int = 2
    """Sequences per rank per forward/backward pass."""
    global_batch: int = 8
    """Sequences per optimizer step over all ranks; accumulation = global / (micro x world)."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still logged)."""
    eval_every: int = 0
    """Run validation every N steps (0 = never)."""
    eval_batches: int = 2
    """Global batches of the validation split per evaluation."""
    requeue_exit_code: int = 75
    """Exit code after a SIGTERM/SIGUSR1-triggered save, so a wrapper can requeue (EX_TEMPFAIL). A Ctrl-C
    (SIGINT) also saves first, but exits with 130: the user stopped the run, nothing should requeue it."""
    retain_freed_memory: bool = True
    """Keep freed host memory for reuse instead of returning it to the OS (glibc): ~12% faster CPU steps for
    ~15% more resident memory (``kernels.cpu_math.retain_freed_memory``)."""
    compile: Literal["none", "blocks"] = "none"
    """``blocks``: ``torch.compile`` each transformer block in place (identical blocks share one compiled graph;
    ``pipeline.train.parallel.compile_blocks``). Off by default: the first step then compiles for minutes on CPU,
    and its speed-up and bf16 numerics on the GPU are not measured yet."""


DEFAULT_MIX_FAMILIES = {"single": 1.0, "multikey": 1.0, "multivalue": 1.0, "multiquery": 1.0, "vt": 1.0}
"""The families of a mix that names none: HiLS-Attention's set, equal weights. ``multihop`` is left out because
it needs two retrieval groups (``model.groups=[n, m]``) to be solvable."""


@dataclass
class RetrievalMixConfig:
    fraction: float = 0.0
    """Share of the training sequences that get a retrieval task written over their own text (0.05: 5%)."""
    families: dict[str, float] = field(default_factory=dict)
    """Weight per family (``single``, ``multikey``, ``multivalue``, ``multiquery``, ``vt``, ``multihop``); the
    families named are the only ones drawn. Empty: ``DEFAULT_MIX_FAMILIES`` (the first five, equal weights)."""
    answer_weight: float = 1.0
    """Loss weight of a task's answer tokens relative to every other token (the loss is the weighted mean). 1 is
    the plain LM loss; a larger weight strengthens the retrieval signal of short runs."""
    retriever_loss: float = 0.0
    """Weight of the retriever's supervised loss, added to the LM loss: on every task sequence, the question's
    landmark scores every earlier chunk and is trained to put its softmax mass on the asked needles' chunks
    (``model.retrieval.needle_loss``). 0: the retriever learns from the LM loss alone. It reaches needles the
    retriever does not pick yet, and trains the retriever while a dense conversion's GCA output is still zero."""
    retriever_loss_each: bool = False
    """With ``retriever_loss``: every asked needle chunk is a target of its own (the loss averages their
    log-probabilities), so each must rank high -- what an answer copied out of several chunks needs (a UUID value
    spans four 16-token chunks). False: the softmax mass on the asked chunks as one set, which one chunk can fill."""
    needles: int = 4
    """multikey, multiquery: needles per sample (distinct names)."""
    values: int = 3
    """multivalue: values of the asked name, all asked for."""
    queries: int = 2
    """multiquery: needles asked for."""
    hops: int = 2
    """vt: copies after the value in each chain."""
    chains: int = 2
    """vt, multihop: chains per sample, the asked one included. multihop: with top-k retrieval and ``chains <=
    top_k``, fetching every key needle always brings the asked one; more chains make that shortcut fail."""
    value_kind: str = "number"
    """Every family's values: ``number`` (5 digits) or ``uuid`` (random UUIDs, 8-4-4-4-12 hex digits, as in RULER's
    ``niah_single_3``; multikey needles then say "uuid" where they say "number"). One kind per training stage;
    ``variants`` mix kinds."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named samples of their own shape, drawn like families with their weight in ``families``: each names its
    ``family`` and the shape keys (``needles``, ``values``, ``queries``, ``hops``, ``chains``, ``value_kind``) that
    differ from this section's, e.g. ``{uuid_single: {family: multikey, needles: 1, queries: 1, value_kind: uuid}}``
    (RULER's ``niah_single_3``) beside 4-needle number samples of the same family."""


SHAPE_KEYS = ("needles", "values", "queries", "hops", "chains", "value_kind")
"""The ``data.retrieval_mix`` keys that make a sample's ``TaskShape`` (a variant may set each)."""


@dataclass(frozen=True)
class MixSettings:
    """The retrieval mix a config asks for, from ``data.retrieval_mix`` or its older ``data.needle_*`` spelling."""

    fraction: float
    families: dict[str, float]
    shape: TaskShape
    answer_weight: float
    retriever_loss: float = 0.0
    retriever_loss_each: bool = False
    variants: dict[str, tuple[str, TaskShape]] = field(default_factory=dict)
    """Variant name -> (its family, its shape)."""


def mix_variants(m: RetrievalMixConfig, shape: TaskShape) -> dict[str, tuple[str, TaskShape]]:
    """``data.retrieval_mix.variants`` read into (family, shape) pairs, each shape ``shape`` with the variant's keys.

    Raises:
        ConfigError: a variant named like a family, without a known ``family``, or with a key that is not a shape key
            or a value its shape refuses (one line naming the variant and key).
    """
    out = {}
    for name, keys in m.variants.items():
        where = f"data.retrieval_mix.variants.{name}"
        if name in FAMILIES:
            raise ConfigError(f"{where}: a variant cannot take a family's name ({list(FAMILIES)})")
        keys = dict(keys)
        family = keys.pop("family", None)
        if family not in FAMILIES:
            raise ConfigError(f"{where}.family must be one of {list(FAMILIES)}; got {family!r}")
        unknown = sorted(set(keys) - set(SHAPE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: {unknown} are not shape keys; a variant sets only family and {SHAPE_KEYS}")
        try:
            variant = dataclasses.replace(shape, **keys)
            variant.check()
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: {err}") from None
        out[name] = (family, variant)
    return out


def mix_settings(data: DataConfig) -> MixSettings:
    """The one reading of the mix keys (the older ``needle_*`` keys take effect when ``needle_mix > 0``)."""
    if data.needle_mix > 0:
        return MixSettings(
            fraction=data.needle_mix,
            families={data.needle_variant: 1.0},
            shape=TaskShape(chains=data.hop_chains),
            answer_weight=data.needle_answer_weight,
        )
    m = data.retrieval_mix
    shape = TaskShape(**{key: getattr(m, key) for key in SHAPE_KEYS})
    return MixSettings(
        fraction=m.fraction,
        families=dict(m.families) or dict(DEFAULT_MIX_FAMILIES),
        shape=shape,
        answer_weight=m.answer_weight,
        retriever_loss=m.retriever_loss,
        retriever_loss_each=m.retriever_loss_each,
        variants=mix_variants(m, shape),
    )


@dataclass
class SourceConfig:
    """One source of a weighted data mixture (``data.sources``, ``pipeline/data/mixture.py``)."""

    path: str | None = None
    """A prepared dataset, local or remote, as ``data.path`` (``task: text``); unset for ``task: retrieval``."""
    weight: float = 1.0
    """Share of the packed training sequences (so of the training tokens) this source gives, relative to the other
    sources' weights (they are normalised to sum to 1)."""
    label: str | None = None
    """Name in the logs, metrics and phases (``[A-Za-z0-9_.-]``); default: the dataset directory's name, or
    ``retrieval``."""
    task: Literal["text", "retrieval"] = "text"
    """``text``: the dataset's documents. ``retrieval``: synthetic retrieval tasks (``data.retrieval_mix``'s
    families and shape) written over sequences of the ``host`` source's text."""
    host: str | None = None
    """``task: retrieval``: the label of the text source whose sequences carry the tasks (default: the first)."""
    min_doc_tokens: int = 0
    """Length bucket: only documents of at least this many tokens (0 or a power of two)."""
    max_doc_tokens: int | None = None
    """Length bucket: only documents of fewer than this many tokens (unset or a power of two)."""
    max_repeat: float | None = 1.0
    """Epochs of this source (of its bucket) the run may draw; more is an error before any work. Unset: no cap."""


@dataclass
class PhaseConfig:
    """A later stage of the mixture (``data.phases``): other weights from ``start_step`` on."""

    start_step: int = MISSING
    """The first step (0-based step count before it, > 0) that draws with these weights."""
    weights: dict[str, float] = field(default_factory=dict)
    """Weight per source label; a source not named draws nothing in this phase."""


@dataclass
class DataConfig:
    path: str = MISSING
    """Data-prep output: a local directory or a remote URL holding ``train/``, ``val/``, ``tokenizer.model``. With
    ``data.sources`` it may be left out: it is then the first text source's path, whose tokenizer, EOS and
    vocabulary the run uses (every source must share that tokenizer)."""
    train_split: str = "train"
    """Sub-directory of the training split."""
    val_split: str = "val"
    """Sub-directory of the validation split."""
    cache_dir: str | None = None
    """Where a remote ``data.path``'s shards are downloaded once, shared by the node's readers and kept (default:
    ``<run_dir>/data_cache``); a local dataset is decoded in memory and writes nothing; never inside ``data.path``."""
    shuffle: bool = True
    """Shuffle the training data (false: every epoch reads the split in file order)."""
    shuffle_scope: Literal["blocks", "window"] = "blocks"
    """``blocks``: every epoch a new order of the shards, and of the documents and sequences within each block of
    ``shuffle_block_mib`` (``pipeline/data/order.py``). ``window``: the order before that existed (shards per
    epoch, then sequences within windows of ``shuffle_window`` consecutive ones), kept to resume and reproduce runs
    made with it."""
    shuffle_block_mib: int = 64
    """``blocks``: decoded shard bytes one block may span, which every rank holds in memory while it reads it."""
    shuffle_window: int = 64
    """``window``: packed sequences shuffled together; larger mixes more, costs memory on every rank."""
    retrieval_mix: RetrievalMixConfig = field(default_factory=RetrievalMixConfig)
    """Synthetic retrieval tasks written over a share of the training sequences (``pipeline/data/mix.py``)."""
    needle_mix: float = 0.0
    """Older spelling of ``retrieval_mix`` with one family: the fraction (``retrieval_mix.fraction``)."""
    needle_variant: str = "single"
    """With ``needle_mix``: its one family (``retrieval_mix.families={<family>: 1}``)."""
    hop_chains: int = 2
    """With ``needle_mix``: ``retrieval_mix.chains``."""
    needle_answer_weight: float = 1.0
    """With ``needle_mix``: ``retrieval_mix.answer_weight``."""
    validate_hash: str | None = None
    """Shard hash checked on read (e.g. ``xxh64``), if data prep wrote one."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture of prepared datasets (and the retrieval tasks) instead of ``data.path`` alone
    (docs/training.md, "Data mixtures"). Empty: ``data.path`` is the one source."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """Later stages of ``data.sources`` with other weights, in order of ``start_step``."""

    def order(self) -> Literal["blocks", "window", "file"]:
        """The order the training split is read in: ``blocks`` (`shuffle_scope`'s default), ``window``, or ``file``
        (``shuffle=false``: the window reader without shuffling)."""
        if not self.shuffle:
            return "file"
        return self.shuffle_scope


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (after warm-up)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay (reached at ``train.max_steps``)."""
    weight_decay: float = 0.1
    """AdamW decay on matrices only; norms, biases, embeddings and landmark vectors get none."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    trainable: Literal["all", "new"] = "all"
    """``all``: every parameter trains. ``new`` (``model.arch=gca``): only what a conversion from a dense model adds
    (``model.convert.parameter_role`` other than ``dense``: GCA cross-attention, the chunk encoder, the retriever);
    the dense weights are frozen (stage 1 of continued pretraining, docs/cpt.md)."""
    lr_scale: dict[str, float] = field(default_factory=dict)
    """Learning-rate multiplier per parameter role (``dense``, ``gca``, ``memory``, ``retriever``; unnamed: 1),
    applied to the scheduled LR at every step, e.g. ``{retriever: 3.0}`` for a faster retriever. Empty keeps the
    optimizer's two parameter groups of a run without it (so its checkpoints resume unchanged)."""


@dataclass
class ScheduleConfig:
    warmup_steps: int = 0
    """Linear warm-up steps from lr/warmup_steps to ``optim.lr``."""
    decay: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine from ``optim.lr`` to ``optim.min_lr``, or constant ``optim.lr``."""


@dataclass
class ParallelConfig:
    engine: Literal["deepspeed", "fsdp", "none"] = "none"
    """``deepspeed`` (ZeRO 0-3), ``fsdp`` (PyTorch FSDP2) or ``none`` (plain module; data parallel if ranks > 1)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (``parallel.engine=deepspeed`` only)."""
    offload_optimizer: bool = False
    """DeepSpeed: keep optimizer state in CPU memory (ZeRO >= 1)."""
    offload_params: bool = False
    """DeepSpeed: keep parameters in CPU memory (ZeRO 3)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward pass."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3-like) or keep them (ZeRO-2-like)."""
    context_parallel: int = 1
    """Ranks that split each sequence between them (``model/context_parallel.py``); it must divide the world size,
    and the data-parallel degree is world size / context_parallel. > 1 needs ``parallel.engine=fsdp`` and
    ``model.arch=gca``."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """A bf16 run's dtype for summing gradients over micro-batches and over ranks; an fp32 run sums in fp32 whatever
    this says. ``fp32``: DeepSpeed ZeRO 1-3 and FSDP2 accumulate and reduce in fp32 (DeepSpeed ZeRO-0 cannot: a
    config error). ``bf16``: they accumulate and reduce in bf16, for less gradient memory and traffic and bf16
    rounding in every sum (tests/pipeline/test_grad_accum_dtype.py measures it). ``parallel.engine=none`` keeps fp32
    gradients (fp32 parameters under autocast) either way; ``bf16`` makes DDP all-reduce them in bf16."""


@dataclass
class PrecisionConfig:
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: ``auto`` is bf16 on CUDA and fp32 on CPU. Master weights stay fp32."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0 = only at the end and on SIGTERM/SIGUSR1)."""
    keep_last: int = 3
    """Committed checkpoints kept; older ones are deleted after a new one commits."""
    resume: str = "auto"
    """``auto`` (latest committed checkpoint in ``run_dir``, else fresh), ``none``, or a checkpoint directory."""
    fallback_to_previous: bool = True
    """With ``resume=auto``: a newest checkpoint that fails verification or holds a pickle that could run code is
    named in a warning, renamed to ``step_N.rejected`` unread (kept, never deleted) and the newest intact one is
    resumed from; ``false``: the run stops with exit 2 instead, changing nothing."""
    export: bool = True
    """Write an eval export (safetensors + config.json + tokenizer.model) into every checkpoint."""
    init_from: str | None = None
    """An eval export directory whose weights start a fresh run (a curriculum stage, fine-tuning); the optimizer,
    schedule and data start anew. A checkpoint of this run (``resume``) takes precedence. ``hf:<dir>``: a dense
    Llama/Mistral/Qwen2 ``transformers`` folder converted into this GCA model (``model/convert.py``, docs/cpt.md).
    Either way the shape keys (``model.convert.DENSE_KEYS``: vocab, widths, heads, norm eps, RoPE base, ties, ...)
    are read from its ``config.json``; one set in the config must agree (the error names the key and both
    values)."""


@dataclass
class LogConfig:
    every: int = 10
    """Console/metrics/wandb logging interval in steps."""
    wandb: bool = False
    """Log to Weights & Biases (rank 0)."""
    wandb_project: str = "gca-pretrain"
    """wandb project name."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """``auto``: ``$WANDB_MODE`` when set, else online when WANDB_API_KEY is set, else offline (never waits on the
    network)."""
    progress: bool = True
    """tqdm progress bar with ETA on the rank-0 console."""
    peak_tflops: float | None = None
    """Per-device peak TFLOP/s for MFU; ``None`` guesses from the CUDA device name (no MFU on CPU)."""


@dataclass
class TrainEvalConfig:
    """Evaluation during training beyond the validation loss: the extrapolation monitor
    (``pipeline.train.callbacks.extrapolation``)."""

    extrapolation_every: int = 0
    """Run the extrapolation monitor every N steps (0 = never): a passkey probe and perplexity by context at
    multiples of ``train.seq_len``, on rank 0, logged as ``extrap/*`` step metrics."""
    extrapolation_lengths: list[int] = field(default_factory=lambda: [1, 16, 256])
    """Probe lengths as multiples of ``train.seq_len`` (a probe of multiple m reads m x seq_len tokens)."""
    extrapolation_samples: int = 2
    """Passkey samples per length (one per depth, spread evenly over the haystack), and validation windows the
    perplexity is averaged over."""
    extrapolation_score_len: int | None = None
    """Tokens scored at the end of each validation window, with the tokens before them as context; ``None``:
    min(train.seq_len // 2, 1024). Must be shorter than the shortest probe length."""
    extrapolation_budget_s: float = 120.0
    """Wall-clock seconds the probes of one monitor step may take (shortest first); a probe still running when
    it is spent is abandoned, and it and every probe after it count in ``extrap/skipped``."""


@dataclass
class TrainConfig:
    run_dir: str = MISSING
    """Output directory: checkpoints, metrics.jsonl, export/, wandb/."""
    seed: int = 1234
    """Seeds weights, data order, needles and Gumbel noise; the same seed gives the same run."""
    model: GCAConfig = field(default_factory=GCAConfig)
    """The architecture (``model/config.py``)."""
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LogConfig = field(default_factory=LogConfig)
    eval: TrainEvalConfig = field(default_factory=TrainEvalConfig)

    def data_parallel(self, world_size: int) -> int:
        """Data-parallel degree: the ranks of a context-parallel group share their sequences."""
        return world_size // self.parallel.context_parallel

    def grad_accum(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.train.global_batch // (self.train.micro_batch * self.data_parallel(world_size))

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.train.seq_len

    @property
    def extrapolation_score_len(self) -> int:
        """``eval.extrapolation_score_len``, or its default: half the training length, at most 1024 tokens."""
        configured = self.eval.extrapolation_score_len
        return configured if configured is not None else default_score_len(self.train.seq_len)


def env_interpolations(cfg: TrainConfig) -> dict[str, str]:
    """Dotted key -> raw ``${oc.env:...}`` text of every config node whose value came from the environment.

    Kept next to the config (not in its schema) so that everything written from it can store the interpolation
    instead of the value (see ``data_prep.redaction``).
    """
    return getattr(cfg, _ENV_PATHS, {})


def load_config(path: str | Path | None, overrides: Sequence[str] = (), world_size: int = 1) -> TrainConfig:
    """Load YAML + dotlist overrides into a validated ``TrainConfig``.

    Args:
        path: YAML file with values only (or ``None`` to start from the defaults).
        overrides: ``key=value`` strings, applied after the YAML.
        world_size: number of ranks the run will use, for the batch-divisibility rule.

    Raises:
        ConfigError: unknown key, wrong type, missing value or a broken cross-field rule; the message names the
            full key.
    """
    cfg, env_paths = load_schema(TrainConfig, path, overrides, what="train", derive=_derived_model_keys)
    setattr(cfg, _ENV_PATHS, env_paths)
    validate(cfg, world_size)
    return cfg


def _derived_model_keys(merged: DictConfig, origins: Mapping[str, str]) -> dict[str, Any]:
    """The ``model.*`` values a config may leave out: ``checkpoint.init_from``'s shapes, and ``model.vocab_size``
    from the dataset's tokenizer when neither the config nor init_from sets it (a value the config sets is kept, and
    `pipeline.train.inputs.check_inputs` checks it against the tokenizer)."""
    derived = _init_from_model_keys(merged, origins)
    path = OmegaConf.select(merged, "data.path", throw_on_missing=False, throw_on_resolution_failure=False)
    first = _first_text_source(merged)
    if path is None and first is not None:
        derived["data.path"] = path = first  # the tokenizer, the EOS and the vocabulary come from it
    if "model.vocab_size" not in origins and "model.vocab_size" not in derived:
        size = _dataset_vocab_size(path)
        if size is not None:
            derived["model.vocab_size"] = size
    return derived


def _first_text_source(merged: DictConfig) -> str | None:
    """The path of the first text source of ``data.sources``, if any."""
    for source in OmegaConf.select(merged, "data.sources", throw_on_missing=False) or []:
        if source.get("task", "text") == "text" and isinstance(source.get("path"), str):
            return str(source.get("path"))
    return None


def _dataset_vocab_size(path: object) -> int | None:
    """The tokenizer size data prep recorded in ``path``'s manifest (the one ``check_inputs`` then matches the
    tokenizer file against by sha256, so the file itself is never parsed here). None when there is none to read: a
    remote or hand-written dataset, or a path that is not a prepared dataset, where the schema default stays and
    ``check_inputs`` says what is wrong."""
    if not isinstance(path, str) or is_remote(path):
        return None
    try:
        return fmt.read_manifest(path).tokenizer.vocab_size
    except (OSError, ValueError, fmt.IncompleteDatasetError):
        return None


def _init_from_model_keys(merged: DictConfig, origins: Mapping[str, str]) -> dict[str, Any]:
    """``checkpoint.init_from``'s shapes (``model.convert.checkpoint_model_keys``) as ``model.*`` values, so a CPT
    config holds only the layout keys. A key the config file or an override set explicitly must agree (even one
    set to the schema default); a key left out takes the checkpoint's value. A native init_from without
    ``model.safetensors`` derives nothing: ``validate`` refuses it."""
    init_from = OmegaConf.select(merged, "checkpoint.init_from")
    if init_from is None:
        return {}
    dense = init_from.startswith(HF_INIT_PREFIX)
    directory = init_from.removeprefix(HF_INIT_PREFIX)
    if not dense and not (Path(directory) / "model.safetensors").is_file():
        return {}
    try:
        values = checkpoint_model_keys(directory, dense=dense)
    except (ConversionError, ExportError, FileNotFoundError) as err:
        raise ConfigError(f"checkpoint.init_from={init_from!r}: {err}") from None
    for key, want in values.items():
        source = origins.get(f"model.{key}")
        have = OmegaConf.select(merged, f"model.{key}")
        if source is not None and have != want:
            raise ConfigError(
                f"model.{key}={have!r} (in {source}) does not fit checkpoint.init_from={init_from}, which needs "
                f"model.{key}={want!r}: leave model.{key} out (it is read from the checkpoint) or set "
                f"model.{key}={want!r}"
            )
    return {f"model.{key}": want for key, want in values.items()}


def _numbers(node: Any, path: str = "") -> list[tuple[str, float]]:
    """Every float of a plain config tree as (dotted key, value); list items as ``key[i]``."""
    if isinstance(node, dict):
        return [item for key, value in node.items() for item in _numbers(value, f"{path}.{key}" if path else key)]
    if isinstance(node, list):
        return [item for i, value in enumerate(node) for item in _numbers(value, f"{path}[{i}]")]
    return [(path, node)] if isinstance(node, float) else []


def _check_finite(cfg: TrainConfig) -> None:
    """No NaN or infinity anywhere: every range rule below is a comparison, which NaN would pass or fail silently
    (``grad_clip=nan`` once turned clipping off)."""
    for key, value in _numbers(OmegaConf.to_container(OmegaConf.structured(cfg))):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number; got {value}")


def _check_outputs_outside_data(cfg: TrainConfig) -> None:
    """The run writes to run_dir and the shard cache; neither may be inside a dataset (``data.path``, or any
    source of ``data.sources``), which is only read."""
    datasets = [("data.path", cfg.data.path)]
    datasets += [(f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources) if s.path]
    for data_key, path in datasets:
        if "://" in path:
            continue
        for key, value in (("run_dir", cfg.run_dir), ("data.cache_dir", cfg.data.cache_dir)):
            if value is not None and is_within(Path(value), Path(path)):
                raise ConfigError(
                    f"{key}={value} is inside {data_key}={path}; the dataset is only ever read: put {key} outside it"
                )


def _check_ranges(cfg: TrainConfig) -> None:
    """Per-key ranges of the numeric settings that have no cross-field rule."""
    t, o = cfg.train, cfg.optim
    if cfg.seed < 0:
        raise ConfigError(f"seed must be >= 0; got {cfg.seed}")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps must be > 0; got {o.eps}")
    if t.eval_batches < 1:
        raise ConfigError(f"train.eval_batches must be >= 1; got {t.eval_batches}")
    if not 1 <= t.requeue_exit_code <= 255:
        raise ConfigError(f"train.requeue_exit_code must be an exit code in 1..255; got {t.requeue_exit_code}")
    if cfg.logging.peak_tflops is not None and not cfg.logging.peak_tflops > 0:
        raise ConfigError(f"logging.peak_tflops must be > 0 (or null to guess); got {cfg.logging.peak_tflops}")


def _check_extrapolation(cfg: TrainConfig, world_size: int) -> None:
    """The monitor's settings, checked even while it is off, so that turning it on never meets a stale typo."""
    e = cfg.eval
    if e.extrapolation_every < 0:
        raise ConfigError(f"eval.extrapolation_every must be >= 0 (0 = off); got {e.extrapolation_every}")
    lengths = e.extrapolation_lengths
    if not lengths or min(lengths) < 1:
        raise ConfigError(
            f"eval.extrapolation_lengths must be a non-empty list of positive integers (multiples of "
            f"train.seq_len); got {lengths}"
        )
    if len(set(lengths)) != len(lengths):
        raise ConfigError(f"eval.extrapolation_lengths must not repeat a length; got {lengths}")
    if e.extrapolation_samples < 1:
        raise ConfigError(f"eval.extrapolation_samples must be >= 1; got {e.extrapolation_samples}")
    shortest = min(lengths) * cfg.train.seq_len
    if not 1 <= cfg.extrapolation_score_len < shortest:
        raise ConfigError(
            f"eval.extrapolation_score_len={cfg.extrapolation_score_len} must be >= 1 and shorter than the shortest "
            f"probe, min(eval.extrapolation_lengths) x train.seq_len = {shortest} tokens (the tokens before the "
            "scored ones are the context)"
        )
    budget = e.extrapolation_budget_s
    if not budget > 0:
        raise ConfigError(f"eval.extrapolation_budget_s must be > 0; got {budget}")
    if e.extrapolation_every and world_size > 1:
        # The other ranks wait for rank 0's probes in a collective, which fails after the collective timeout;
        # half of it leaves room for gathering the weights and for the segment that overruns the budget.
        try:
            timeout = collective_timeout_s()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if budget > timeout / 2:
            raise ConfigError(
                f"eval.extrapolation_budget_s={budget} must be at most half the collective timeout "
                f"({timeout:g} s, {TIMEOUT_ENV}): the other {world_size - 1} rank(s) wait for the monitor in a "
                f"collective; lower the budget or raise {TIMEOUT_ENV}"
            )


def _batch_fixes(t: TrainLoopConfig, data_parallel: int) -> str:
    """What would make the batch arithmetic work on ``data_parallel`` ranks: a smaller micro batch that keeps the
    global batch (and so the training recipe), or the nearest global batch that keeps the micro batch."""
    micro = [m for m in range(t.micro_batch - 1, 0, -1) if t.global_batch % (m * data_parallel) == 0]
    per_step = t.micro_batch * data_parallel
    nearest = max(per_step, round(t.global_batch / per_step) * per_step)
    keep = f"train.micro_batch={micro[0]} keeps the global batch" if micro else "no micro batch keeps the global batch"
    return f"{keep}, or train.global_batch={nearest} keeps the micro batch"


def check_context_parallel(cfg: TrainConfig, world_size: int) -> None:
    """``parallel.context_parallel`` fits the world size, the engine, the architecture and the sequence length.

    Called by ``validate`` with the world size the launcher announced, and again by the trainer with the one the
    process group has (a ``Trainer`` can be built without ``load_config``)."""
    cp, p, m = cfg.parallel.context_parallel, cfg.parallel, cfg.model
    if cp < 1:
        raise ConfigError(f"parallel.context_parallel must be >= 1; got {cp}")
    if world_size % cp != 0:
        raise ConfigError(
            f"parallel.context_parallel={cp} must divide the world size {world_size} (data-parallel degree = world "
            "size / context_parallel)"
        )
    if cp == 1:
        return
    if p.engine != "fsdp":
        # DeepSpeed would average the CP shares over its data-parallel group instead of summing them; the plain
        # engine's DDP would need the same loss scaling: only FSDP2 is wired and tested.
        raise ConfigError(f"parallel.context_parallel={cp} > 1 needs parallel.engine=fsdp; got {p.engine}")
    if m.arch != "gca":
        raise ConfigError(f"parallel.context_parallel={cp} > 1 needs model.arch=gca; got {m.arch}")
    if m.retrieval_scope == "document":
        raise ConfigError(
            f"parallel.context_parallel={cp} > 1 does not support model.retrieval_scope=document (a rank would need "
            "the document boundaries of the other ranks' spans); use context_parallel=1 or retrieval_scope=sequence"
        )
    if cfg.train.eval_every and cfg.train.global_batch % world_size:
        # The validation pass (pipeline.train.callbacks.validation) is not context-parallel: it shards whole sequences
        # over every rank, and a rank's share rounds down to nothing or drops sequences.
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} must be divisible by the world size {world_size} when "
            f"train.eval_every > 0 with parallel.context_parallel={cp}: validation shares whole sequences out over "
            "every rank"
        )
    try:
        check_cp_spans(m, cfg.train.seq_len, cp)
    except ValueError as err:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} is too short for parallel.context_parallel={cp}: {err}"
        ) from None


def check_grad_reduce_dtype(cfg: TrainConfig, bf16: bool) -> None:
    """``parallel.grad_reduce_dtype`` is one the engine can honour in a run whose compute dtype is bf16 (``bf16``).

    Called by ``validate`` when ``precision.dtype=bf16`` says so before any device is known, and again by
    ``build_deepspeed_config`` with the dtype the trainer resolved (``auto`` is bf16 on CUDA)."""
    p = cfg.parallel
    if bf16 and p.engine == "deepspeed" and p.zero_stage == 0 and p.grad_reduce_dtype == "fp32":
        # DeepSpeed 0.19 raises NotImplementedError("unsupported mix of model_dtype ... and grad_accum_dtype") for
        # bf16 parameters with fp32 accumulation without ZeRO (engine.py _do_optimizer_sanity_check). ZeRO-1 has it
        # (BF16_Optimizer: a whole fp32 gradient on every rank, as ZeRO-0 has a bf16 one; the optimizer state sharded).
        raise ConfigError(
            "parallel.grad_reduce_dtype=fp32 in a bf16 run needs parallel.zero_stage >= 1 with "
            "parallel.engine=deepspeed (DeepSpeed sums ZeRO-0 gradients only in bf16): set parallel.zero_stage=1, or "
            "parallel.grad_reduce_dtype=bf16 to accept bf16 gradient sums"
        )


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Cross-field rules; each error states the rule and the values."""
    _check_finite(cfg)
    _check_ranges(cfg)
    _check_extrapolation(cfg, world_size)
    _check_outputs_outside_data(cfg)
    t, o, p, c = cfg.train, cfg.optim, cfg.parallel, cfg.checkpoint
    positive: tuple[tuple[str, float], ...] = (
        ("train.max_steps", t.max_steps),
        ("train.seq_len", t.seq_len),
        ("train.micro_batch", t.micro_batch),
        ("train.global_batch", t.global_batch),
        ("checkpoint.keep_last", c.keep_last),
        ("logging.every", cfg.logging.every),
        ("data.shuffle_window", cfg.data.shuffle_window),
        ("data.shuffle_block_mib", cfg.data.shuffle_block_mib),
    )
    for key, value in positive:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1; got {value}")
    non_negative: tuple[tuple[str, float], ...] = (
        ("checkpoint.every", c.every),
        ("train.eval_every", t.eval_every),
        ("schedule.warmup_steps", cfg.schedule.warmup_steps),
        ("train.grad_clip", t.grad_clip),
        ("optim.weight_decay", o.weight_decay),
    )
    for key, value in non_negative:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0; got {value}")
    check_context_parallel(cfg, world_size)
    dp = cfg.data_parallel(world_size)
    if t.global_batch % (t.micro_batch * dp) != 0:
        ranks = "world size" if dp == world_size else "data-parallel ranks (world size / parallel.context_parallel)"
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by train.micro_batch x {ranks} = "
            f"{t.micro_batch} x {dp} = {t.micro_batch * dp}; {_batch_fixes(t, dp)}"
        )
    n_chunks = t.seq_len // cfg.model.chunk_size
    if cfg.model.arch == "gca" and cfg.model.top_k > n_chunks:  # the baselines retrieve nothing
        raise ConfigError(
            f"model.top_k={cfg.model.top_k} is larger than the number of chunks per sequence, "
            f"train.seq_len // model.chunk_size = {t.seq_len} // {cfg.model.chunk_size} = {n_chunks}"
        )
    _check_trainable(cfg)
    if not 0 < o.lr:
        raise ConfigError(f"optim.lr must be > 0; got {o.lr}")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.min_lr must satisfy 0 <= optim.min_lr <= optim.lr; got min_lr={o.min_lr}, lr={o.lr}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas must be two values in [0, 1); got {o.betas}")
    if cfg.schedule.warmup_steps >= t.max_steps:
        raise ConfigError(f"schedule.warmup_steps={cfg.schedule.warmup_steps} must be < train.max_steps={t.max_steps}")
    _check_mix(cfg.data)
    if cfg.model.retrieval_scope == "document" and mix_settings(cfg.data).fraction > 0:
        # A task is written over a packed sequence that may hold an end-of-document token between a needle and its
        # question; the document scope would hide the needle, and the sample would teach a wrong answer.
        raise ConfigError(
            "model.retrieval_scope=document cannot train with the retrieval-task mix (data.retrieval_mix.fraction > 0 "
            "or data.needle_mix > 0): its tasks are written over packed text that may cross documents, and a needle "
            "before an end-of-document token would be hidden from its question; use one or the other"
        )
    _check_retriever_loss(cfg)
    if not 0 <= p.zero_stage <= 3:
        raise ConfigError(f"parallel.zero_stage must be 0, 1, 2 or 3; got {p.zero_stage}")
    if p.engine != "deepspeed" and (p.zero_stage or p.offload_optimizer or p.offload_params):
        raise ConfigError(
            f"parallel.zero_stage / offload_optimizer / offload_params need parallel.engine=deepspeed; got "
            f"engine={p.engine}, zero_stage={p.zero_stage}, offload_optimizer={p.offload_optimizer}, "
            f"offload_params={p.offload_params}"
        )
    if p.offload_optimizer and p.zero_stage < 1:
        raise ConfigError(f"parallel.offload_optimizer needs parallel.zero_stage >= 1; got {p.zero_stage}")
    if p.offload_params and p.zero_stage != 3:
        raise ConfigError(f"parallel.offload_params needs parallel.zero_stage=3; got {p.zero_stage}")
    check_grad_reduce_dtype(cfg, bf16=cfg.precision.dtype == "bf16")
    if c.init_from is not None and c.init_from.startswith(HF_INIT_PREFIX):
        try:
            check_fits(cfg.model, c.init_from[len(HF_INIT_PREFIX) :])
        except ConversionError as err:
            raise ConfigError(f"checkpoint.init_from={c.init_from!r}: {err}") from None
    elif c.init_from is not None and not (Path(c.init_from) / "model.safetensors").is_file():
        raise ConfigError(
            f"checkpoint.init_from must be a model export directory (with model.safetensors); got {c.init_from!r}"
        )
    if c.resume not in ("auto", "none") and not Path(c.resume).is_dir():
        raise ConfigError(
            f"checkpoint.resume must be 'auto', 'none' or an existing checkpoint directory; got {c.resume!r}"
        )


def _check_trainable(cfg: TrainConfig) -> None:
    o = cfg.optim
    if o.trainable == "new" and cfg.model.arch != "gca":
        raise ConfigError("optim.trainable=new needs model.arch=gca (the other archs have no new parameters)")
    unknown = sorted(set(o.lr_scale) - set(PARAMETER_ROLES))
    if unknown:
        raise ConfigError(f"optim.lr_scale: unknown role(s) {unknown}; the roles are {list(PARAMETER_ROLES)}")
    for role, scale in o.lr_scale.items():
        if not 0 < scale < float("inf"):
            raise ConfigError(f"optim.lr_scale.{role} must be a finite number > 0; got {scale}")


def _check_retriever_loss(cfg: TrainConfig) -> None:
    """``data.retrieval_mix.retriever_loss > 0`` needs tasks to supervise and a learned retriever over whole
    sequences."""
    weight, m = cfg.data.retrieval_mix.retriever_loss, cfg.model
    if weight == 0:
        if cfg.data.retrieval_mix.retriever_loss_each:
            raise ConfigError(
                "data.retrieval_mix.retriever_loss_each=true shapes the retriever's supervised loss, which is off "
                "(data.retrieval_mix.retriever_loss=0); set a weight > 0 or leave it false"
            )
        return
    key = f"data.retrieval_mix.retriever_loss={weight}"
    tasks = mix_settings(cfg.data).fraction > 0 or any(s.task == "retrieval" for s in cfg.data.sources)
    rules = (
        (
            not tasks,
            "needs retrieval tasks (data.retrieval_mix.fraction > 0 or a data.sources entry with task: retrieval)",
        ),
        (m.arch != "gca", f"needs model.arch=gca (a retriever); got {m.arch}"),
        (m.retrieval == "random", "supervises a learned retriever; got model.retrieval=random"),
        (not m.retrieval_grad, "trains the retriever; got model.retrieval_grad=false"),
        (
            m.retrieval_scope == "document",
            "scores every earlier chunk of the sequence; got model.retrieval_scope=document",
        ),
        (
            cfg.parallel.context_parallel > 1,
            f"scores whole sequences; got parallel.context_parallel={cfg.parallel.context_parallel}",
        ),
    )
    for broken, why in rules:
        if broken:
            raise ConfigError(f"{key} {why}")


def _check_mix(data: DataConfig) -> None:
    """The mix keys' values and that only one spelling is used; whether ``train.seq_len`` holds each family's
    sample needs the tokenizer and is checked with the inputs (``pipeline.train.inputs``)."""
    m = data.retrieval_mix
    for key, value in (("data.needle_mix", data.needle_mix), ("data.retrieval_mix.fraction", m.fraction)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key} must be in [0, 1]; got {value}")
    for key, value in (
        ("data.needle_answer_weight", data.needle_answer_weight),
        ("data.retrieval_mix.answer_weight", m.answer_weight),
    ):
        if not value > 0:
            raise ConfigError(f"{key} must be > 0; got {value}")
    if not 0 <= m.retriever_loss < float("inf"):
        raise ConfigError(f"data.retrieval_mix.retriever_loss must be a finite weight >= 0; got {m.retriever_loss}")
    if data.needle_variant not in FAMILIES:
        raise ConfigError(f"data.needle_variant must be one of {list(FAMILIES)}; got {data.needle_variant!r}")
    if data.needle_mix > 0:
        changed = [
            f"data.retrieval_mix.{f.name}"
            for f in dataclasses.fields(RetrievalMixConfig)
            if getattr(m, f.name) != getattr(RetrievalMixConfig(), f.name)
        ]
        if changed:
            raise ConfigError(
                f"data.needle_mix={data.needle_mix} and {changed[0]} are two spellings of one mix: set "
                "data.retrieval_mix.* only (data.needle_mix=0)"
            )
    elif data.needle_answer_weight != 1.0 or data.hop_chains != 2:
        key = "needle_answer_weight" if data.needle_answer_weight != 1.0 else "hop_chains"
        new = "answer_weight" if key == "needle_answer_weight" else "chains"
        raise ConfigError(
            f"data.{key} applies only with data.needle_mix > 0; with data.retrieval_mix set data.retrieval_mix.{new}"
        )
    variants = mix_variants(m, TaskShape(**{key: getattr(m, key) for key in SHAPE_KEYS}))
    unknown = sorted(set(m.families) - set(FAMILIES) - set(variants))
    if unknown:
        raise ConfigError(
            f"data.retrieval_mix.families: unknown {unknown}; the families are {list(FAMILIES)}"
            + (f" and the variants {list(variants)}" if variants else "")
        )
    unused = sorted(set(variants) - set(m.families))
    if unused:
        raise ConfigError(
            f"data.retrieval_mix.variants: {unused} have no weight in data.retrieval_mix.families, so they are never "
            "drawn; give each a weight there"
        )
    for name, weight in m.families.items():
        if not 0 <= weight < float("inf"):
            raise ConfigError(f"data.retrieval_mix.families.{name} must be a finite weight >= 0; got {weight}")
    if m.families and not any(w > 0 for w in m.families.values()):
        raise ConfigError(f"data.retrieval_mix.families={dict(m.families)} gives no family a weight above 0")
    settings = mix_settings(data)
    if data.needle_mix > 0 and data.hop_chains < 2:
        raise ConfigError(f"data.hop_chains must be >= 2 (the asked chain and a distractor); got {data.hop_chains}")
    if settings.families.get("multihop", 0) > 0 and settings.shape.chains < 2:
        raise ConfigError(
            f"data.retrieval_mix.chains must be >= 2 for multihop (the asked chain and a distractor); got "
            f"{settings.shape.chains}"
        )
    try:
        settings.shape.check()
    except ValueError as err:
        raise ConfigError(f"data.retrieval_mix.{err}") from None


def to_plain(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config as nested dicts, with every environment-derived value put back as its
    ``${oc.env:...}`` text (what wandb and every written config get)."""
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    return restore_env_interpolations(resolved, env_interpolations(cfg))


def to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML (what the run log, ``config.yaml`` and every checkpoint record): resolved, except that
    values from the environment stay ``${oc.env:...}``, so the file holds no such value and re-runs as it is."""
    return OmegaConf.to_yaml(OmegaConf.create(to_plain(cfg)))

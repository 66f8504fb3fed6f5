"""``EvalConfig``: the keys of ``launch/eval.py`` (``key=value`` overrides on an optional YAML), validated once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.schema import ConfigError, load_schema
from pipeline.data.needle import VALUE_KINDS, NeedleSpec, check_templates
from pipeline.data.retrieval_tasks import FAMILIES
from pipeline.evaluation.passkey import PasskeyGrid
from pipeline.evaluation.ppl import MAX_DEFAULT_SCORE_LEN, default_score_len
from pipeline.evaluation.ruler import RULER_TASKS, SYNTHETIC_TASKS, RulerGrid
from pipeline.evaluation.runtime import StreamBudget, check_device

TASKS = ("ppl", "passkey", "ruler")
PPL_DOCUMENTS = ("documents", "windows")

log = logging.getLogger(__name__)


@dataclass
class EvalConfig(NeedleSpec):
    """The eval keys. The passkey keys (``variant``, ``needle``, ``question``, ``answer``, ``link``, ``needles``,
    ``values``, ``queries``, ``hops``, ``chains``, ``key_digits``) are ``NeedleSpec``'s own fields, written once
    there."""

    lengths: list[int] = field(default_factory=lambda: [2048, 4096, 16384])
    """Sequence lengths in tokens (each at least one chunk); ppl: context lengths, each above ``score_len``."""
    data: str = "builtin"
    """Token source: builtin | noise | stdlib | an MDS split | a prepared dataset dir (val) | text file(s) | a
    dir."""
    samples: int = 4
    """ppl: the most documents scored per length (the first long enough); passkey: samples per (length, depth);
    ruler: samples per (task, length)."""
    score_len: int | None = None
    """ppl: the final tokens of each document scored at every context length (default: half the shortest length,
    at most 1024; ``pipeline.evaluation.ppl.default_score_len``)."""
    ppl_documents: str = "documents"
    """ppl: documents (each document of ``data``; builtin: ``samples`` seeded filler documents of the longest
    length) | windows (the token stream, documents joined with EOS, cut into windows of the longest length)."""
    document_ppl: bool = True
    """ppl: also stream every whole document from its start (a ``"document"`` row). Its cost grows with the
    documents' length, quadratically for ``model.arch=full``."""
    seed: int = 0
    segment: int = 4096
    """Tokens per forward_stream call: bounds activation memory, any value gives the same logits."""
    device: str = "cpu"
    attn_backend: str | None = None
    """Override the export's GCA backend (naive | triton | auto)."""
    offload_mb: int = 1024
    """Chunk K/V kept in RAM per sequence before spilling to an on-disk memmap; -1 keeps everything in RAM."""
    offload_dir: str | None = None
    """Where the memmap temp dir goes (default: the system temp dir)."""
    progress: bool = True
    """Show tqdm progress bars (tokens/s)."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """passkey: needle depths, fractions of the haystack before the key-bearing needle."""
    restart: bool = False
    """passkey, ruler: discard the samples an earlier run finished in ``--out`` (``<task>.samples.jsonl``) instead
    of resuming from them; a run whose settings differ from theirs is refused without it."""
    ruler_tasks: list[str] = field(default_factory=lambda: list(SYNTHETIC_TASKS))
    """ruler: the tasks to run (``pipeline.evaluation.ruler.RULER_TASKS``, lm-eval's names; default: all but the QA
    ones); ``samples`` per task and length; ``data`` is their haystack (``noise``: RULER's noise text);
    ``key_digits`` sizes their keys."""
    qa_squad: str | None = None
    """ruler: a local SQuAD JSON file (e.g. ``dev-v2.0.json``) that ``ruler_qa_squad`` draws its questions and
    documents from."""
    qa_hotpot: str | None = None
    """ruler: a local HotpotQA JSON file (e.g. ``hotpot_dev_distractor_v1.json``) for ``ruler_qa_hotpot``."""


MAX_KEY_DIGITS = 18
"""Keys are drawn as int64: 10**19 no longer fits."""

RUN_KEYS = ("lengths", "data", "samples", "seed", "segment", "device", "attn_backend", "offload_mb", "offload_dir")
"""The keys every task reads: what it scores, on what, and how it streams (the last four decide the time and the
memory a result records)."""
TASK_KEYS = {
    "ppl": ("score_len", "ppl_documents", "document_ppl"),
    "passkey": ("depths", *(f.name for f in dataclasses.fields(NeedleSpec))),
    "ruler": ("ruler_tasks", "key_digits", "qa_squad", "qa_hotpot"),
}
"""Each task's own keys."""
UNRECORDED_KEYS = ("progress", "restart")
"""Keys that change nothing a result holds: the progress bars, and whether finished samples are reused (a sample's
record does not depend on it)."""


def result_config(cfg: EvalConfig, task: str) -> dict:
    """The keys of ``cfg`` that decide ``task``'s result, as ``<task>.json`` records them: ``RUN_KEYS`` and the
    task's own ``TASK_KEYS`` (another task's keys decide nothing here)."""
    values = dataclasses.asdict(cfg)
    return {key: values[key] for key in (*RUN_KEYS, *TASK_KEYS[task])}


def load_eval_config(
    path: str | None, overrides: Sequence[str], task: str | None = None
) -> tuple[EvalConfig, dict[str, str]]:
    """YAML (optional) + ``key=value`` overrides -> ``(validated EvalConfig, env_paths)``; unknown keys are errors.

    ``env_paths`` maps every key whose text reads the environment (``${oc.env:NAME}``) to that text, for
    ``restore_env_interpolations`` when the config is written out. ``task`` adds that task's cross-key rules.

    Raises:
        ConfigError: a bad key, value or file, named (values from the environment redacted).
    """
    cfg, env_paths = load_schema(EvalConfig, path, overrides, what="eval")
    validate(cfg, task=task)
    if cfg.score_len is None:  # after validate: the lengths it derives from are checked
        cfg.score_len = default_score_len(min(cfg.lengths))
        if task == "ppl":
            log.info(
                "score_len not set: scoring the final %d tokens of each document (half the shortest length, at most "
                "%d; set score_len to choose)",
                cfg.score_len,
                MAX_DEFAULT_SCORE_LEN,
            )
    return cfg, env_paths


def validate(cfg: EvalConfig, chunk_size: int | None = None, task: str | None = None) -> None:
    """Value rules, each naming the key and value; with ``chunk_size`` also "every length holds a chunk", with
    ``task`` that task's rules across keys."""
    if not cfg.lengths or any(n < 2 for n in cfg.lengths):
        raise ConfigError(f"lengths={cfg.lengths}: need at least one length, each >= 2")
    if chunk_size is not None and min(cfg.lengths) < chunk_size:
        raise ConfigError(
            f"lengths={cfg.lengths}: {min(cfg.lengths)} is below one chunk of the model "
            f"(chunk_size={chunk_size}); retrieval needs whole chunks"
        )
    for key in ("samples", "segment", "key_digits", "needles", "values", "queries", "hops", "chains", "score_len"):
        value = getattr(cfg, key)
        if value is not None and value < 1:  # score_len is None until its default is derived from lengths
            raise ConfigError(f"{key}={value} must be >= 1")
    if task == "ppl" and cfg.score_len is not None and cfg.score_len >= min(cfg.lengths):
        raise ConfigError(
            f"score_len={cfg.score_len} must be below the shortest length ({min(cfg.lengths)} in lengths="
            f"{cfg.lengths}): each length scores the final score_len tokens after length - score_len of context"
        )
    if cfg.ppl_documents not in PPL_DOCUMENTS:
        raise ConfigError(f"ppl_documents={cfg.ppl_documents!r} is not one of {PPL_DOCUMENTS}")
    if cfg.value_kind not in VALUE_KINDS:
        raise ConfigError(f"value_kind={cfg.value_kind!r} is not one of {VALUE_KINDS}")
    if cfg.key_digits > MAX_KEY_DIGITS:
        raise ConfigError(f"key_digits={cfg.key_digits} must be <= {MAX_KEY_DIGITS}")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    if cfg.offload_mb < -1:
        raise ConfigError(
            f"offload_mb={cfg.offload_mb} must be >= 0 (MiB of chunk K/V kept in RAM) or -1 (everything in RAM)"
        )
    if cfg.offload_dir is not None and not Path(cfg.offload_dir).is_dir():
        raise ConfigError(
            f"offload_dir={cfg.offload_dir!r} is not an existing directory; create it or leave "
            "it unset (the system temp dir)"
        )
    unknown = [name for name in cfg.ruler_tasks if name not in RULER_TASKS]
    if unknown or not cfg.ruler_tasks or len(set(cfg.ruler_tasks)) < len(cfg.ruler_tasks):
        raise ConfigError(
            f"ruler_tasks={cfg.ruler_tasks}: need distinct names among {list(RULER_TASKS)}"
            + (f" ({unknown} unknown)" if unknown else "")
        )
    for name in cfg.ruler_tasks:
        qa = RULER_TASKS[name].qa
        if qa is not None and getattr(cfg, f"qa_{qa}") is None:
            raise ConfigError(f"ruler_tasks has {name}, which reads a local {qa} file: set qa_{qa}=<path to it>")
    for key in ("qa_squad", "qa_hotpot"):
        path = getattr(cfg, key)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{key}={path!r} is not a file")
    if cfg.variant not in FAMILIES:
        raise ConfigError(f"variant={cfg.variant!r} is not one of {FAMILIES}")
    if cfg.variant == "multiquery" and cfg.queries > cfg.needles:
        raise ConfigError(f"queries={cfg.queries} cannot exceed needles={cfg.needles} (multiquery asks some of them)")
    if cfg.variant == "multihop" and cfg.needles < 2:
        raise ConfigError(f"needles={cfg.needles}: multihop needs >= 2 (a link and a key needle)")
    # NaN fails both comparisons, so it is refused here too.
    if not cfg.depths or any(not 0.0 <= d <= 1.0 for d in cfg.depths):
        raise ConfigError(f"depths={cfg.depths}: need at least one depth, each in [0, 1]")
    try:
        check_device(cfg.device)
        check_templates(needle_spec(cfg))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def needle_spec(cfg: EvalConfig) -> NeedleSpec:
    """The passkey keys of ``cfg`` as the ``NeedleSpec`` the passkey task runs."""
    return NeedleSpec(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(NeedleSpec)})


def passkey_grid(cfg: EvalConfig) -> PasskeyGrid:
    """The samples ``--task passkey`` runs."""
    return PasskeyGrid(needle_spec(cfg), cfg.lengths, cfg.depths, cfg.samples, cfg.seed)


def ruler_grid(cfg: EvalConfig) -> RulerGrid:
    """The samples ``--task ruler`` runs."""
    qa_files = {fmt: path for fmt, path in (("squad", cfg.qa_squad), ("hotpot", cfg.qa_hotpot)) if path is not None}
    return RulerGrid(list(cfg.ruler_tasks), cfg.lengths, cfg.samples, cfg.seed, cfg.key_digits, qa_files)


def stream_budget(cfg: EvalConfig) -> StreamBudget:
    """How every task streams its inputs."""
    return StreamBudget(cfg.segment, cfg.offload_mb, cfg.offload_dir)

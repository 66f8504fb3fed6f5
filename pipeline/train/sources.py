"""The training mixture a config asks for: ``data.sources`` and ``data.phases``, or ``data.path`` alone (one source
of weight 1, plus the retrieval tasks of ``data.retrieval_mix`` as a second source of weight ``fraction``).

`resolve_mixture` reads the config (errors name the key), `check_mixture` checks the datasets and the budgets before
any work (one line, exit 2) and logs the table of what the run will draw, and `build_stream` makes the
``pipeline.data.mixture.MixtureStream`` the trainer reads.
"""

from __future__ import annotations

import logging
import math
import re
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from data_prep import format as fmt
from pipeline.data.mixture import MixtureStream, Phase, Schedule, Source, exact_weights, phase_record
from pipeline.data.order import BlockShuffledSequences
from pipeline.data.reader import MDSReader, PackedSequences, SourceStream, dataset_fingerprint, is_remote
from pipeline.train.config import ConfigError, TrainConfig, mix_settings

log = logging.getLogger(__name__)

LABEL = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RETRIEVAL_LABEL = "retrieval"


@dataclass(frozen=True)
class MixtureSource:
    """One resolved source."""

    label: str
    task: Literal["text", "retrieval"]
    path: str | None
    host: str
    """The label of the text source whose sequences it takes (a text source: its own)."""
    bucket: tuple[int, int | None]
    max_repeat: float | None
    key: str
    """The config key that declares it (for errors)."""


@dataclass(frozen=True)
class Mixture:
    """The resolved mixture of a config."""

    sources: list[MixtureSource]
    phases: list[Phase]
    """Starts in global sequences (``start_step * train.global_batch``)."""
    declared: bool
    """Whether the config declares ``data.sources`` (else ``data.path`` is the one text source)."""

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.sources]

    def index(self, label: str) -> int:
        return self.labels.index(label)


def resolve_mixture(cfg: TrainConfig) -> Mixture:
    """The mixture ``cfg`` asks for.

    Raises:
        ConfigError: naming the key and value of a bad source or phase.
    """
    d, batch = cfg.data, cfg.train.global_batch
    settings = mix_settings(d)
    if not d.sources:
        if d.phases:
            raise ConfigError("data.phases needs data.sources (the labels its weights name)")
        label = _label_of(d.path) if isinstance(d.path, str) else "data"
        text = MixtureSource(label, "text", d.path, label, (0, None), None, "data.path")
        if settings.fraction == 0:
            return Mixture([text], [Phase(0, exact_weights([1.0]))], declared=False)
        task = MixtureSource(RETRIEVAL_LABEL, "retrieval", None, label, (0, None), None, "data.retrieval_mix")
        weights = exact_weights([1 - settings.fraction, settings.fraction])
        return Mixture([text, task], [Phase(0, weights)], declared=False)
    if settings.fraction > 0:
        key = "data.needle_mix" if d.needle_mix > 0 else "data.retrieval_mix.fraction"
        raise ConfigError(
            f"{key}={settings.fraction} with data.sources: declare the retrieval tasks as a source instead, e.g. "
            "{task: retrieval, weight: 0.05} in data.sources (data.retrieval_mix keeps their families and shape)"
        )
    sources = [_resolve_source(cfg, i) for i in range(len(d.sources))]
    labels = [s.label for s in sources]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            raise ConfigError(f"data.sources[{i}].label={label!r} is used twice; give each source its own label")
    texts = [s.label for s in sources if s.task == "text"]
    if not texts:
        raise ConfigError("data.sources has no text source (task: text with a path): the tasks need text to host them")
    resolved = []
    for i, s in enumerate(sources):
        if s.task == "retrieval":
            host = d.sources[i].host or texts[0]
            if host not in texts:
                raise ConfigError(
                    f"data.sources[{i}].host={host!r} is not the label of a text source; the text sources are {texts}"
                )
            s = MixtureSource(s.label, s.task, None, host, s.bucket, None, s.key)
        resolved.append(s)
    phases = [Phase(0, _weights(labels, {s.label: d.sources[i].weight for i, s in enumerate(sources)}, "data.sources"))]
    previous = 0
    for n, phase in enumerate(d.phases):
        key = f"data.phases[{n}]"
        if phase.start_step <= previous:
            raise ConfigError(
                f"{key}.start_step={phase.start_step} must be > {previous} (the phases start after step 0, in order)"
            )
        unknown = sorted(set(phase.weights) - set(labels))
        if unknown:
            raise ConfigError(f"{key}.weights names {unknown}, which no source has; the labels are {labels}")
        phases.append(Phase(phase.start_step * batch, _weights(labels, dict(phase.weights), f"{key}.weights")))
        previous = phase.start_step
    return Mixture(resolved, phases, declared=True)


def declared_retrieval_share(mixture: Mixture) -> float:
    """The first phase's share of the ``task: retrieval`` sources of a declared mixture (0 without one): what the
    retrieval mix records as its fraction."""
    if not mixture.declared:
        return 0.0
    return float(sum(w for s, w in zip(mixture.sources, mixture.phases[0].weights) if s.task == "retrieval"))


def _label_of(path: str) -> str:
    name = Path(path.rstrip("/")).name
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    return cleaned or "data"


def _resolve_source(cfg: TrainConfig, i: int) -> MixtureSource:
    s, key = cfg.data.sources[i], f"data.sources[{i}]"
    if s.task == "text" and not s.path:
        raise ConfigError(f"{key}.path is required for a text source (task: text)")
    if s.task == "retrieval":
        if s.path:
            raise ConfigError(
                f"{key}.path={s.path}: a retrieval source has no dataset (its host source gives the text)"
            )
        if s.min_doc_tokens or s.max_doc_tokens is not None:
            raise ConfigError(f"{key}: a retrieval source takes no length bucket (give it to its host source)")
    elif s.host is not None:
        raise ConfigError(f"{key}.host is for a retrieval source (task: retrieval)")
    label = s.label if s.label is not None else (RETRIEVAL_LABEL if s.task == "retrieval" else _label_of(str(s.path)))
    if not LABEL.fullmatch(label):
        raise ConfigError(f"{key}.label={label!r} must be 1-64 characters of letters, digits, '_', '.' or '-'")
    low, high = s.min_doc_tokens, s.max_doc_tokens
    for name, bound in ((f"{key}.min_doc_tokens", low), (f"{key}.max_doc_tokens", high)):
        if bound is not None and bound != 0 and (bound < 0 or bound & (bound - 1)):
            raise ConfigError(
                f"{name}={bound} must be 0 or a power of two (data prep's length histogram counts documents in "
                "power-of-two bins, so only such bounds are counted exactly)"
            )
    if high is not None and high <= low:
        raise ConfigError(f"{key}: max_doc_tokens={high} must be > min_doc_tokens={low}")
    if (low or high is not None) and cfg.data.order() != "blocks":
        raise ConfigError(f"{key}: a length bucket needs data.shuffle_scope=blocks and data.shuffle=true")
    if s.max_repeat is not None and not (s.max_repeat > 0 and math.isfinite(s.max_repeat)):
        raise ConfigError(f"{key}.max_repeat={s.max_repeat} must be a finite number > 0, or unset for no cap")
    return MixtureSource(label, s.task, s.path, label, (low, high), s.max_repeat, key)


def _weights(labels: list[str], given: dict[str, float], key: str) -> tuple[Fraction, ...]:
    for label, w in given.items():
        if not (math.isfinite(w) and w >= 0):
            where = f"{key}.{label}" if key.endswith("weights") else f"the weight of {label!r} in {key}"
            raise ConfigError(f"{where} = {w}: a weight must be a finite number >= 0")
    values = [given.get(label, 0.0) for label in labels]
    if sum(values) <= 0:
        raise ConfigError(f"{key}: the weights sum to 0; give at least one source a weight > 0")
    return exact_weights(values)


# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceBudget:
    """What one source holds and what the run draws from it (the startup table)."""

    label: str
    weights: list[float]
    """Per phase."""
    tokens: int | None
    """Tokens the source holds (its bucket, an EOS per document included); None: unknown (remote, no manifest)."""
    drawn: int
    """Sequences of ``seq_len`` tokens the run's ``train.max_steps`` take from it (its own, for a text source; for a
    retrieval source, those it writes tasks over)."""
    read: int
    """Sequences read from its text (a text source: its own plus the retrieval sequences it hosts)."""

    def epochs(self, seq_len: int) -> float | None:
        return None if self.tokens is None else self.read * seq_len / max(1, self.tokens)


def budgets(cfg: TrainConfig, mixture: Mixture, manifests: dict[str, fmt.Manifest]) -> list[SourceBudget]:
    """Per source: weights, tokens available (from its manifest in ``manifests``, by label; none: unknown) and
    sequences drawn over ``train.max_steps`` (exactly, from the schedule).

    Raises:
        ConfigError: a bucket over a dataset whose manifest has no length histogram.
    """
    total = cfg.train.max_steps * cfg.train.global_batch
    counts = Schedule(mixture.phases).counts(total, len(mixture.sources))
    out = []
    for i, s in enumerate(mixture.sources):
        hosted = sum(
            int(counts[j]) for j, o in enumerate(mixture.sources) if o.task == "retrieval" and o.host == s.label
        )
        tokens = _available_tokens(cfg, s, manifests.get(s.label)) if s.task == "text" else None
        read = int(counts[i]) + (hosted if s.task == "text" else 0)
        out.append(SourceBudget(s.label, [float(p.weights[i]) for p in mixture.phases], tokens, int(counts[i]), read))
    return out


def _available_tokens(cfg: TrainConfig, source: MixtureSource, manifest: fmt.Manifest | None) -> int | None:
    if manifest is None:  # a remote dataset
        if source.bucket != (0, None):
            raise ConfigError(
                f"{source.key}: a length bucket needs data prep's manifest.json in {source.path} (its length histogram)"
            )
        return None
    split = manifest.splits.get(cfg.data.train_split)
    if split is None:
        return 0
    if source.bucket == (0, None):
        return split.tokens + split.documents
    histogram = split.length_histogram
    if histogram is None:
        raise ConfigError(
            f"{source.key}: a length bucket needs the length histogram data prep records in manifest.json, and "
            f"{source.path} has none (prepared before it existed): re-run make prep on its input"
        )
    documents, tokens = fmt.bucket_tokens(histogram, source.bucket[0], source.bucket[1])
    return tokens + documents


def check_mixture(cfg: TrainConfig) -> Mixture:
    """Resolve the mixture, check that its text sources are local prepared datasets of one tokenizer (or remote),
    and that each has the tokens its share of ``train.max_steps`` reads within its ``max_repeat``; log the table.

    Raises:
        ConfigError: one line naming the source, its tokens and what the run needs.
    """
    mixture = resolve_mixture(cfg)
    if not mixture.declared:
        return mixture
    manifests: dict[str, fmt.Manifest] = {}
    for s in mixture.sources:
        if s.task != "text" or s.path is None or is_remote(s.path):
            continue
        if not (Path(s.path) / fmt.MANIFEST_FILENAME).is_file():
            raise ConfigError(
                f"{s.key}.path={s.path} is not a prepared dataset (no {fmt.MANIFEST_FILENAME}): prepare it with "
                "make prep (launch/prep.py)"
            )
        try:
            manifests[s.label] = fmt.read_manifest(s.path)
        except (OSError, ValueError, fmt.IncompleteDatasetError) as err:
            raise ConfigError(f"{s.key}.path={s.path}: {err}") from None
    tokenizers = {label: manifest.tokenizer.sha256 for label, manifest in manifests.items()}
    first = next(iter(tokenizers.items()), None)
    for label, sha in tokenizers.items():
        if first is not None and sha != first[1]:
            raise ConfigError(
                f"data.sources: source {label!r} was tokenized with another tokenizer than {first[0]!r} (tokenizer "
                f"sha256 {sha[:12]} vs {first[1][:12]}): prepare every source with the same tokenizer "
                "(make prep tokenizer.model=<the first one's tokenizer.model>)"
            )
    _check_primary_tokenizer(cfg, mixture, tokenizers)
    seq_len = cfg.train.seq_len
    rows = budgets(cfg, mixture, manifests)
    for s, row in zip(mixture.sources, rows):
        if s.task != "text" or row.tokens is None:
            continue
        need = row.read * seq_len
        if row.tokens == 0 and row.read:
            raise ConfigError(
                f"{s.key} ({s.label}): the source holds no tokens in its split or bucket, and the run "
                f"draws {row.read} sequences from it"
            )
        if s.max_repeat is not None and need > row.tokens * s.max_repeat:
            raise ConfigError(
                f"{s.key} ({s.label}) is too small for its share: it holds {row.tokens:,} tokens, the run reads "
                f"{need:,} from it over train.max_steps={cfg.train.max_steps} ({need / row.tokens:.2f} epochs) but "
                f"max_repeat={s.max_repeat:g}; raise its max_repeat, lower its weight or train.max_steps, or add data"
            )
    log_table(cfg, mixture, rows)
    return mixture


def _check_primary_tokenizer(cfg: TrainConfig, mixture: Mixture, tokenizers: dict[str, str]) -> None:
    """``data.path`` gives a mixture run its tokenizer, EOS, vocabulary and the export's tokenizer: when a config
    sets it to a dataset that is not one of the sources (a base config's ``data.path`` under an added
    ``data.sources``), it must share the sources' tokenizer."""
    path = cfg.data.path
    first = next((s for s in mixture.sources if s.task == "text"), None)
    if first is None or not tokenizers or is_remote(path) or any(s.path == path for s in mixture.sources):
        return
    if not (Path(path) / fmt.MANIFEST_FILENAME).is_file():
        raise ConfigError(
            f"data.path={path} is not one of data.sources and not a prepared dataset; it gives the run its tokenizer "
            f"and vocabulary: set data.path={first.path} (the first source), or leave it out"
        )
    try:
        sha = fmt.read_manifest(path).tokenizer.sha256
    except (OSError, ValueError, fmt.IncompleteDatasetError) as err:
        raise ConfigError(f"data.path={path}: {err}") from None
    label, source_sha = next(iter(tokenizers.items()))
    if sha != source_sha:
        raise ConfigError(
            f"data.path={path} was tokenized with another tokenizer than the sources ({label!r}: sha256 "
            f"{source_sha[:12]} vs {sha[:12]}), and it gives the run its tokenizer, vocabulary and export: set "
            f"data.path={first.path} (the first source), or leave it out"
        )


def log_table(cfg: TrainConfig, mixture: Mixture, rows: list[SourceBudget]) -> None:
    """The startup table: per source its weights, tokens available, tokens drawn and epochs."""
    seq_len = cfg.train.seq_len
    lines = [f"data mixture over {cfg.train.max_steps} steps ({len(mixture.phases)} phase(s)):"]
    lines.append(f"  {'source':<20} {'weights':<18} {'tokens':>15} {'drawn':>15} {'epochs':>7}")
    for row in rows:
        weights = "/".join(f"{w:.3g}" for w in row.weights)
        tokens = "unknown" if row.tokens is None else f"{row.tokens:,}"
        epochs = row.epochs(seq_len)
        shown = "-" if epochs is None else f"{epochs:.2f}"
        lines.append(f"  {row.label:<20} {weights:<18} {tokens:>15} {row.drawn * seq_len:>15,} {shown:>7}")
    log.info("%s", "\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------


def source_seed(seed: int, label: str, mixture: Mixture) -> int:
    """The data-order seed of a text source: the run's seed for ``data.path`` alone (its order as before mixtures),
    else one per label, so two sources over one dataset do not read it in the same order."""
    return seed if not mixture.declared else zlib.crc32(f"{seed}:{label}".encode())


def build_stream(
    cfg: TrainConfig, mixture: Mixture, eos_id: int | None, cache: str
) -> tuple[MixtureStream, dict[str, Any]]:
    """The global training stream of ``mixture`` and the fingerprint of its primary dataset (``data.path``).

    Every declared text source is one ``MDSReader`` with its own order stream; the record a checkpoint keeps names
    each source's definition and dataset fingerprint, and each phase's start and exact weights."""
    d = cfg.data
    streams: dict[int, SourceStream] = {}
    definitions: dict[str, dict[str, Any]] = {}
    primary: dict[str, Any] | None = None
    for i, s in enumerate(mixture.sources):
        if s.task != "text":
            definitions[s.label] = {"task": s.task, "host": s.host}
            continue
        assert s.path is not None
        reader = MDSReader(s.path, d.train_split, cache, d.validate_hash)
        fingerprint = dataset_fingerprint(reader, s.path)
        if primary is None:
            primary = fingerprint
        seed = source_seed(cfg.seed, s.label, mixture)
        streams[i] = _order_stream(cfg, reader, seed, eos_id, s)
        definitions[s.label] = {"task": s.task, "bucket": list(s.bucket), **fingerprint}
    assert primary is not None
    record = None
    if mixture.declared:
        record = {"sources": definitions, "phases": [phase_record(p, mixture.labels) for p in mixture.phases]}
    sources = [Source(s.label, s.task, mixture.index(s.host)) for s in mixture.sources]
    return MixtureStream(sources, streams, Schedule(mixture.phases), record), primary


def _order_stream(cfg: TrainConfig, reader: MDSReader, seed: int, eos_id: int | None, s: MixtureSource) -> SourceStream:
    d = cfg.data
    if d.order() == "blocks":
        spanning: dict[int, int] = {}
        if s.bucket != (0, None):
            split = fmt.read_manifest(str(s.path)).splits[d.train_split]
            histogram = split.length_histogram
            assert histogram is not None, "check_mixture refused a bucket without a histogram"
            spanning = histogram.spanning_lengths()
        return BlockShuffledSequences(
            reader,
            seq_len=cfg.train.seq_len,
            seed=seed,
            block_mib=d.shuffle_block_mib,
            eos_id=eos_id,
            bucket=s.bucket,
            spanning=spanning,
        )
    return PackedSequences(
        reader, seq_len=cfg.train.seq_len, seed=seed, shuffle=d.shuffle, window=d.shuffle_window, eos_id=eos_id
    )

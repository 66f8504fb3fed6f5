"""The prep config: a typed schema, YAML for values, ``key=value`` overrides, errors that name the key.

Loading goes through the shared loader (``data_prep.schema``): the YAML file and the dotlist overrides merged onto
``PrepConfig``, converted to a real (frozen) dataclass, then validated here. Unknown keys are rejected with a "did
you mean" suggestion, so the message names the full key.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import MISSING

from data_prep import schema
from data_prep.errors import ConfigError
from data_prep.format import HF_TOKENIZER_JSON
from data_prep.redaction import redact, restore_env_interpolations
from data_prep.schema import INTERNAL, load_schema

__all__ = ["HFConfig", "PrepConfig", "TokenizerConfig", "load_config", "to_container"]


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer produces the tokens: a SentencePiece model (``type=sentencepiece``: set exactly one of `model`
    and `vocab_size`) or a Hugging Face ``tokenizer.json`` (``type=hf``: set `path`)."""

    type: Literal["sentencepiece", "hf"] = "sentencepiece"
    """``sentencepiece``: train one or use `model`; ``hf``: the ``tokenizer.json`` in `path` (a dense model's own
    tokenizer, e.g. Llama-3 or Qwen2), read offline with the ``tokenizers`` library."""
    path: str | None = None
    """``type=hf``: a folder holding ``tokenizer.json`` (and optionally ``tokenizer_config.json``, whose
    ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` name the special ids); nothing is downloaded."""
    model: str | None = None
    """Path to an existing SentencePiece ``.model`` file."""
    vocab_size: int | None = None
    """Train a new model of this size on a sample of the input (train split only)."""
    model_type: Literal["bpe", "unigram"] = "bpe"
    """SentencePiece algorithm for a trained model; BPE trains ~5x faster."""
    sample_bytes: int = 100_000_000
    """About how many bytes of text to train on; documents are sampled by content hash."""
    character_coverage: float = 0.9995
    """Characters outside this share of the sample become byte-fallback tokens."""


@dataclass(frozen=True)
class HFConfig:
    """Options for ``hf:<name>`` inputs, read with the ``datasets`` library: a hub dataset (network or a populated
    HF cache), a packaged builder over ``data_files`` (``hf:json``, ``hf:parquet``, ``hf:arrow``, ``hf:text``;
    local paths or ``hf://datasets/<repo>@<revision>/...`` globs), a local data directory, or a
    ``save_to_disk`` folder."""

    config_name: str | None = None
    """The dataset configuration (``load_dataset(name, config_name)``), e.g. ``arxiv``."""
    split: str = "train"
    """Which upstream split to read; our own train/val split is made by `PrepConfig.val_fraction`."""
    revision: str | None = None
    """A git revision of the dataset repository, for reproducibility."""
    data_files: list[str] = field(default_factory=list)
    """Files (globs) the dataset is built from (``load_dataset(..., data_files=...)``); empty: the dataset's own."""
    data_dir: str | None = None
    """A sub-directory of the dataset repository or local directory to read (``load_dataset(..., data_dir=...)``)."""
    streaming: bool = True
    """Read records as they download (``streaming=True``) instead of building the whole dataset in the HF cache
    first."""


@dataclass(frozen=True)
class PrepConfig:
    """``python launch/prep.py --config configs/data/<name>.yaml [key=value ...]``."""

    output: str = MISSING
    """Directory to create; it is written as a temporary sibling and renamed when complete."""
    input: list[str] = field(default_factory=list)
    """Files, globs or directories (``.txt``, ``.jsonl``, ``.parquet``, optionally ``.gz``/``.zst``),
    ``hf:<name>`` for a Hugging Face dataset, or ``builtin:python_stdlib`` for the offline default corpus.
    A single string is accepted too."""
    exclude: list[str] = field(default_factory=list)
    """Shell-style patterns of input files to leave out (held-out evaluation text), matched against each file's
    path relative to its input directory or built-in corpus root (a glob's matches and named files as written);
    ``*`` matches across ``/``: ``["email/*", "json/*"]`` leaves out two stdlib packages. A pattern that matches
    no file is an error. Records inside one file (jsonl lines, parquet rows, ``hf:`` datasets) are not filtered."""
    format: Literal["auto", "txt", "jsonl", "parquet"] = "auto"
    """File format; ``auto`` decides by extension. A ``.txt`` file is one document, a jsonl line or a
    parquet row is one document."""
    text_field: str = "text"
    """The jsonl / parquet / HF column holding the document text."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    hf: HFConfig = field(default_factory=HFConfig)
    val_fraction: float = 0.01
    """Share of the corpus in the val split (deterministic; see `val_unit`)."""
    val_unit: Literal["auto", "documents", "tokens"] = "auto"
    """What is held out: ``documents`` (whole documents, chosen by a hash of their text), ``tokens`` (the last
    ``val_fraction`` of every document, cut at a word boundary), or ``auto``: whole documents unless they hold out
    less than half or more than twice ``val_fraction`` of the text (a few long books), then tails
    (``data_prep.split``)."""
    split_seed: int = 0
    """Salt of the split hash; change it to draw a different val split."""
    max_piece_tokens: int = 65536
    """Longer documents are stored as consecutive pieces of at most this many tokens."""
    min_tokens: int = 1
    """Documents with fewer tokens are skipped (counted as ``too_short``)."""
    num_proc: int = 1
    """Tokenizer workers: prep encodes on ``num_proc`` x ``encode_threads`` threads of its one process (SentencePiece
    releases the GIL, so threads scale like processes without pickling), and trains the tokenizer on ``num_proc``
    threads."""
    encode_threads: int = 0
    """Encode threads per tokenizer worker; 0: the CPUs this process may run on divided by ``num_proc`` (at least 1),
    so the encode threads never oversubscribe the machine. Never changes the output."""
    shard_size_bytes: int = 1 << 26
    """Uncompressed MDS shard size limit."""
    fingerprint: Literal["stat", "content"] = "stat"
    """How inputs are fingerprinted in the manifest: size + mtime, or sha256 of the content (slow)."""
    strict: bool = False
    """Fail on the first malformed record instead of skipping and counting it."""
    overwrite: bool = False
    """Replace an existing output directory (the old one is removed only after the new one is complete)."""
    progress: bool = True
    """Show tqdm progress bars."""
    num_slices: int = 1
    """Cut the input files into this many contiguous slices, one per job-array task
    (``launch/slurm/prep.sbatch``); ``data_prep.merge`` joins the slices into one dataset. 1 = no slicing."""
    slice_index: int = 0
    """Which slice (0-based) this run prepares. Document ids become ``ordinal * num_slices + slice_index``,
    so they stay unique across slices without any coordination."""
    env_interpolations: dict[str, str] = field(default_factory=dict, metadata=INTERNAL)
    """Set by `load_config`, not by users: dotted key -> raw ``${oc.env:...}`` text of every value that came
    from the environment, so `to_container` can write the interpolation instead of the value."""


def to_container(cfg: PrepConfig) -> dict[str, Any]:
    """The config as plain JSON-able data for the manifest, without values that came from the environment.

    Environment-derived values are written as their ``${oc.env:NAME}`` text, and every other string value is
    redacted of secret shapes (a token pasted into ``hf.revision``). Keys are schema names and stay as they are.
    """
    data = dataclasses.asdict(cfg)
    data.pop("env_interpolations")
    restored = restore_env_interpolations(data, cfg.env_interpolations)
    return _redact_values(restored)


def _redact_values(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _redact_values(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_redact_values(value) for value in node]
    return redact(node) if isinstance(node, str) else node


def load_config(path: str | Path | None, overrides: Sequence[str] | None = None) -> PrepConfig:
    """Load, merge and validate a prep config.

    Args:
        path: a YAML file, or None for defaults plus overrides only.
        overrides: ``key=value`` strings (dotted keys for nested fields, e.g. ``tokenizer.vocab_size=4096``).

    Returns:
        The validated, frozen `PrepConfig`.

    Raises:
        ConfigError: unknown key (with a suggestion), bad value or type (naming key and value), missing file.
    """
    try:
        cfg, env_paths = load_schema(PrepConfig, path, overrides or [], what="prep")
    except schema.ConfigError as err:
        raise ConfigError(str(err)) from None  # the prep flavour, which launch/prep.py reports as a PrepError
    cfg = dataclasses.replace(cfg, env_interpolations=env_paths)
    validate(cfg)
    return cfg


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"bad value {key}={value!r}: {why}")


def validate(cfg: PrepConfig) -> None:
    """Check cross-field and range constraints; raise `ConfigError` naming the key and value."""
    if not cfg.output:
        raise _bad("output", cfg.output, "must be a directory path")
    if not cfg.input:
        raise ConfigError(
            "config key 'input' is required: files, globs, directories, hf:<name> or builtin:<name> "
            "(set it in the prep config file or pass input=...)"
        )
    for item in cfg.input:
        if not item:
            raise _bad("input", cfg.input, "empty entry")
    if any(not pattern for pattern in cfg.exclude):
        raise _bad("exclude", cfg.exclude, "empty pattern")
    tok = cfg.tokenizer
    if tok.type == "hf":
        _validate_hf_tokenizer(tok)
    elif tok.path is not None:
        raise _bad("tokenizer.path", tok.path, "is read only with tokenizer.type=hf (a Hugging Face tokenizer folder)")
    elif (tok.model is None) == (tok.vocab_size is None):
        # Both set is most often a config file that trains one and a command line that names one: say how to lift
        # the file's key, since a key cannot be removed by leaving it out of the overrides.
        both = tok.model is not None
        raise ConfigError(
            "set exactly one of 'tokenizer.model' (an existing SentencePiece model) and "
            f"'tokenizer.vocab_size' (train one); got model={tok.model!r}, vocab_size={tok.vocab_size!r}"
            + (
                "; to use the model, add tokenizer.vocab_size=null (or tokenizer.model=null to train one)"
                if both
                else ""
            )
        )
    if tok.model is not None and not Path(tok.model).is_file():
        raise _bad("tokenizer.model", tok.model, "file does not exist")
    # 256 byte-fallback pieces + unk/bos/eos must fit, with room for at least a few merges.
    if tok.vocab_size is not None and not 300 <= tok.vocab_size < 2**32:
        raise _bad("tokenizer.vocab_size", tok.vocab_size, "must be in [300, 2**32) (256 byte pieces are reserved)")
    if tok.sample_bytes < 1:
        raise _bad("tokenizer.sample_bytes", tok.sample_bytes, "must be positive")
    if not 0.0 < tok.character_coverage <= 1.0:
        raise _bad("tokenizer.character_coverage", tok.character_coverage, "must be in (0, 1]")
    if not 0 <= cfg.split_seed < 2**63:  # xxh64 takes an unsigned 64-bit seed; the tokenizer sample uses seed + 1
        raise _bad("split_seed", cfg.split_seed, "must be in [0, 2**63)")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise _bad("val_fraction", cfg.val_fraction, "must be in [0, 1)")
    if cfg.max_piece_tokens < 1:
        raise _bad("max_piece_tokens", cfg.max_piece_tokens, "must be positive")
    if cfg.min_tokens < 1:
        raise _bad("min_tokens", cfg.min_tokens, "must be at least 1 (empty documents are always skipped)")
    if cfg.num_proc < 1:
        raise _bad("num_proc", cfg.num_proc, "must be at least 1")
    if cfg.encode_threads < 0:
        raise _bad("encode_threads", cfg.encode_threads, "must be 0 (auto) or a thread count")
    # MDS stores sample offsets as uint32, so a shard must stay below 4 GiB.
    if not 1024 <= cfg.shard_size_bytes < 2**32:
        raise _bad("shard_size_bytes", cfg.shard_size_bytes, "must be in [1024, 2**32)")
    if not cfg.text_field:
        raise _bad("text_field", cfg.text_field, "must be a non-empty column name")
    if cfg.num_slices < 1:
        raise _bad("num_slices", cfg.num_slices, "must be at least 1")
    if not 0 <= cfg.slice_index < cfg.num_slices:
        raise _bad("slice_index", cfg.slice_index, f"must be in [0, num_slices={cfg.num_slices})")
    if cfg.num_slices > 1 and tok.type == "sentencepiece" and tok.model is None:
        # Every slice must produce ids from the same tokenizer, or the merged dataset would mix vocabularies; a
        # tokenizer.json is given, never trained, so type=hf always names one.
        raise ConfigError(
            f"num_slices={cfg.num_slices} needs a shared tokenizer: set 'tokenizer.model' (launch/slurm/prep.sbatch "
            "trains one on the whole input first with `launch/slurm/prep_slices.py tokenizer`)"
        )


def _validate_hf_tokenizer(tok: TokenizerConfig) -> None:
    """``tokenizer.type=hf``: `path` names a folder with a readable ``tokenizer.json`` (and ``tokenizer_config.json``
    if any), checked here so that a bad one stops prep before any work; SentencePiece keys are refused (they would be
    silently ignored). Prep reads the files again for the run itself (``data_prep.tokenize.hf_prep_tokenizer``)."""
    from data_prep.hf_tokenizer import read_folder  # the tokenizers library, only when it is used

    for key, value in (("model", tok.model), ("vocab_size", tok.vocab_size)):
        if value is not None:
            raise ConfigError(
                f"tokenizer.{key}={value!r} cannot be combined with tokenizer.type=hf, which tokenizes with the "
                f"tokenizer.json in tokenizer.path={tok.path!r}; drop tokenizer.{key} (when a config file sets it: "
                f"add tokenizer.{key}=null)"
            )
    if tok.path is None:
        raise ConfigError("tokenizer.type=hf needs tokenizer.path=<a folder holding tokenizer.json>")
    folder = Path(tok.path)
    if not folder.is_dir():
        raise _bad("tokenizer.path", tok.path, "is not a directory (a folder holding tokenizer.json)")
    if not (folder / HF_TOKENIZER_JSON).is_file():
        raise _bad("tokenizer.path", tok.path, f"holds no {HF_TOKENIZER_JSON} (a Hugging Face fast tokenizer file)")
    read_folder(tok.path)

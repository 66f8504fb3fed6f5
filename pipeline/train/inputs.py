"""What the trainer checks before any work starts, and the one input it loads into a fresh model.

``check_no_secrets`` and ``check_inputs`` need no process group and write nothing, so a bad config or dataset
costs one error line and exit code 2, never a half-started run (tests/reliability, docs/reliability.md).
``init_weights_from`` loads ``checkpoint.init_from``, refusing an export that does not fit.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep import format as fmt
from data_prep.dataset_tokenizer import HF, SENTENCEPIECE, TokenizerFiles, folder_tokenizer, manifest_mismatch
from data_prep.json_file import summarize
from data_prep.redaction import find_secret, is_secret_name
from data_prep.safe_files import (
    INDEX_FILENAME,
    index_file_names,
    parse_index,
    read_index,
    read_index_bytes,
    stat_regular,
)
from model import CausalLM, GCAForCausalLM, read_export_config
from model.convert import ConversionError, convert_dense_into, weight_files
from model.io import ExportError, check_finite_weights, check_safetensors
from pipeline.data.mix import RetrievalMix, tokenizer_codec
from pipeline.data.reader import UnsafeDatasetError, eos_id_of, is_remote, read_tokenizer, refuse_prep_work_dir
from pipeline.train.checkpoint import OWNER_FILE, foreign_leftovers
from pipeline.train.config import HF_INIT_PREFIX, ConfigError, TrainConfig, mix_settings
from pipeline.train.metrics import resolve_wandb_mode
from pipeline.train.sources import Mixture, check_mixture, declared_retrieval_share, resolve_mixture
from pipeline.train.wandb_online import online_refusal

log = logging.getLogger(__name__)


def check_no_secrets(cfg: TrainConfig) -> None:
    """Refuse a config that would carry a secret into logs, checkpoints and wandb (they all record the config).

    A value equal to or containing the value of a secret-named environment variable (``WANDB_API_KEY``,
    ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...; e.g. through ``${oc.env:WANDB_API_KEY}``) is refused, and so
    is any literal value under a key named like a secret, and any value shaped like a credential (an ``hf_...``
    or ``ghp_...`` token, an AWS key id, a password in a URL; ``data_prep.redaction``). Secrets are read from
    the environment by the libraries that need them, never through the config. The message names the key and
    the variable, never the value.

    Raises:
        ConfigError: naming the config key (and the environment variable).
    """
    from omegaconf import OmegaConf

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        elif isinstance(node, str) and node:
            if is_secret_name(path.rsplit(".", 1)[-1]):
                raise ConfigError(
                    f"config key '{path}' looks like a secret; secrets must come from the environment "
                    "(e.g. WANDB_API_KEY), never from the config, which is logged and checkpointed"
                )
            secret = find_secret(node)
            if secret is not None:
                raise ConfigError(
                    f"config key '{path}' holds {secret}; secrets must not enter the config (it is "
                    "logged, checkpointed and sent to wandb): pass credentials through the environment "
                    "variables the library in question reads, never through ${oc.env:...} or a literal"
                )

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")


def _check_tokenizer(cfg: TrainConfig, manifest: fmt.Manifest | None) -> None:
    """The tokenizer next to data.path must be the one the manifest records (`manifest_mismatch`: by kind and
    sha256, before it is parsed), and fit ``model.vocab_size`` (else an IndexError deep in the embedding)."""
    try:
        tokenizer = read_tokenizer(cfg.data.path)
    except UnsafeDatasetError as err:
        raise ConfigError(str(err)) from None
    if manifest is not None:
        problem = manifest_mismatch(Path(cfg.data.path), manifest.tokenizer, tokenizer)
        if problem is not None:
            raise ConfigError(f"{problem}; re-run data prep, or restore the tokenizer it wrote")
    _check_dense_tokenizer(cfg, tokenizer)
    if tokenizer is None:
        fraction = mix_settings(cfg.data).fraction
        if fraction > 0:
            key = "data.needle_mix" if cfg.data.needle_mix > 0 else "data.retrieval_mix.fraction"
            raise ConfigError(
                f"{key}={fraction} needs the tokenizer next to data.path={cfg.data.path} (tokenizer.model or "
                f"tokenizer.json), which does not exist; set {key}=0 or point data.path at a prepared dataset"
            )
        return  # a hand-written MDS dataset without one; the export says so
    path = Path(cfg.data.path) / tokenizer.name
    try:
        pieces = tokenizer.codec().vocab_size
    except ValueError as err:
        raise ConfigError(
            f"{path} is not a readable tokenizer ({str(err).splitlines()[0]}); re-run data "
            "prep or point data.path at a prepared dataset"
        ) from None
    if pieces > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer {path} has {pieces} pieces but model.vocab_size={cfg.model.vocab_size}: "
            f"token ids would fall outside the embedding; set model.vocab_size={pieces} (or larger)"
        )
    build_mix(cfg, tokenizer)


def build_mix(cfg: TrainConfig, tokenizer: TokenizerFiles | None) -> RetrievalMix | None:
    """The retrieval mix ``cfg`` asks for (``None`` when its fraction is 0), dry-run on ``train.seq_len``.

    Raises:
        ConfigError: ``train.seq_len`` cannot hold one of its families' samples (named, with the reason), or there
            is no tokenizer to write its texts with (a remote ``data.path``).
    """
    settings = mix_settings(cfg.data)
    fraction = settings.fraction or declared_retrieval_share(resolve_mixture(cfg))
    if fraction == 0:
        return None
    if tokenizer is None:
        raise ConfigError(
            f"data.retrieval_mix needs the tokenizer of data.path={cfg.data.path}, which is not a local prepared "
            "dataset; set data.retrieval_mix.fraction=0 (and data.needle_mix=0)"
        )
    try:
        return RetrievalMix(
            tokenizer_codec(tokenizer),
            seq_len=cfg.train.seq_len,
            chunk_size=cfg.model.chunk_size,
            fraction=fraction,
            families=settings.families,
            shape=settings.shape,
            variants=settings.variants,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def split_mismatch(root: Path, split: str, manifest: fmt.Manifest) -> str | None:
    """Why ``root/split`` is not the split data prep recorded in ``manifest`` (None when it is): its ``index.json``
    (which lists every shard's hash) must hash to the manifest's ``index_sha256``, and a split the manifest records
    as empty must not exist. A split copied in from another prep (other token ids) or altered since fails here.
    The counts the manifest records must then be that index's (`data_prep.format.split_count_mismatch`): a manifest
    edited and resealed would otherwise feed wrong counts to every figure derived from them."""
    stats = manifest.splits.get(split)
    if stats is None:
        return None  # not a split data prep wrote (a custom data.train_split); nothing recorded to compare
    index = root / split / "index.json"
    if stats.index_sha256 == fmt.EMPTY_SPLIT_SHA256:
        if index.exists():
            return f"{index} exists, but manifest.json records '{split}' as empty (data prep wrote no such split)"
        return fmt.split_count_mismatch(root, split, manifest, [])
    try:
        raw = read_index_bytes(root / split)
    except FileNotFoundError:
        return f"{index} is missing, though manifest.json records {stats.pieces} samples in '{split}'"
    except (OSError, UnsafeDatasetError) as err:
        return f"cannot read {index}: {err}"
    actual = hashlib.sha256(raw).hexdigest()
    if actual != stats.index_sha256:
        return (
            f"{index} is not the one data prep recorded in manifest.json (sha256 {actual[:16]}... vs recorded "
            f"{stats.index_sha256[:16]}...): the split was replaced or changed after prep (a split from another "
            "prep holds another tokenizer's ids)"
        )
    try:
        shards = parse_index(raw, str(index))["shards"]  # the bytes just hashed, never a second read
    except UnsafeDatasetError as err:
        return str(err)
    return fmt.split_count_mismatch(root, split, manifest, shards) or missing_shards(root / split, shards)


def missing_shards(split_dir: Path, shards: list[dict[str, Any]]) -> str | None:
    """Which shards of a checked index have none of their files in ``split_dir`` as a regular file (None when
    every one has one): the directory is listed once (and a name with a folder in it stat'ed), nothing is opened.
    A resealed index may list 100,000 shards that are not there; found here, in about a second, the run never
    builds readers for them (seconds and hundreds of MiB) to fail at the first one it opens."""
    index = split_dir / "index.json"
    try:
        with os.scandir(split_dir) as entries:
            regular = {entry.name for entry in entries if entry.is_file(follow_symlinks=False)}
        missing = [
            names[0]
            for names in map(index_file_names, shards)
            if not any(name in regular if "/" not in name else stat_regular(split_dir, name) for name in names)
        ]
    except (OSError, UnsafeDatasetError) as err:
        return f"a shard {index} lists cannot be used: {str(err).splitlines()[0]}"
    if not missing:
        return None
    return (
        f"{index} lists {len(missing):,} shard(s) whose files are missing (or not regular files): "
        f"{summarize(missing, 3)}"
    )


def _index_samples(root: Path, split: str) -> int | None:
    """Samples the split's ``index.json`` lists, read as the readers read it (`read_index`: a regular file, a safe
    MDS index); None when there is no index."""
    try:
        index, _ = read_index(root / split)
    except FileNotFoundError:
        return None
    except UnsafeDatasetError as err:
        raise ConfigError(str(err)) from None
    except OSError as err:
        raise ConfigError(f"cannot read {root / split / 'index.json'}: {err.strerror or err}") from None
    return sum(int(shard["samples"]) for shard in index["shards"])


def _read_manifest(root: Path) -> fmt.Manifest | None:
    """The manifest of the local dataset ``root`` (each field checked, `data_prep.format.read_manifest`); None for
    a dataset without one (a hand-written MDS dataset)."""
    if not (root / fmt.MANIFEST_FILENAME).is_file() and not (root / fmt.COMPLETE_MARKER).is_file():
        return None
    try:
        return fmt.read_manifest(root)
    except (fmt.IncompleteDatasetError, ValueError) as err:
        raise ConfigError(f"data.path={root}: {str(err).splitlines()[0]}") from None


def _check_is_dataset(cfg: TrainConfig) -> None:
    """A local ``data.path`` without a manifest must at least hold the training split's MDS index (a dataset
    written by hand). A folder of raw text, or one split of a prepared dataset, is named for what it is before any
    other check, whose advice (a missing validation split, a tokenizer) would send the user the wrong way.

    Raises:
        ConfigError: naming data.path and the command that prepares it (or its parent dataset).
    """
    root = Path(cfg.data.path)
    if os.path.lexists(root / cfg.data.train_split / INDEX_FILENAME):  # a link is judged by the reader
        return
    if os.path.lexists(root / INDEX_FILENAME):
        raise ConfigError(
            f"data.path={root} is one split of a dataset (it holds {INDEX_FILENAME} itself); set data.path to the "
            f"prepared dataset that holds it (data.path={root.resolve().parent})"
        )
    prepared = f"{root.resolve()}_prepared"
    raise ConfigError(
        f"data.path={root} is not a prepared dataset (no {fmt.MANIFEST_FILENAME}, no "
        f"{cfg.data.train_split}/{INDEX_FILENAME} of data.train_split): prepare it with launch/prep.py input={root} "
        f"output={prepared} tokenizer.vocab_size={cfg.model.vocab_size}, then set data.path={prepared}"
    )


def _check_splits(cfg: TrainConfig, manifest: fmt.Manifest | None) -> None:
    """The training split, and the validation split when ``train.eval_every > 0``, are the ones data prep wrote
    (`split_mismatch`, when there is a manifest), and the validation split holds samples: the split on disk
    decides, never a count in the manifest (else a missing ``val/`` fails at the first validation, mid-run)."""
    root = Path(cfg.data.path)
    splits = [("data.train_split", cfg.data.train_split)]
    validated = cfg.train.eval_every and not per_source_validation(cfg)  # else each source's, in validation_sources
    if validated:
        splits.append(("data.val_split", cfg.data.val_split))
    if manifest is not None:
        for key, split in splits:
            problem = split_mismatch(root, split, manifest)
            if problem is not None:
                raise ConfigError(
                    f"data.path={root} ({key}={split}): {problem}; re-run data prep, or restore the split it wrote"
                )
    if not validated:
        return
    found = _index_samples(root, cfg.data.val_split)
    if not found:
        what = "has no" if found is None else "has an empty"
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} but data.path={root} {what} validation split "
            f"'{cfg.data.val_split}' (data.val_split): set train.eval_every=0, or prepare the data with a larger "
            "val_fraction / more documents"
        )


def per_source_validation(cfg: TrainConfig) -> bool:
    """Whether validation runs per source: ``train.eval_every > 0`` and ``data.sources`` declares more than one text
    source (each is then validated on its own ``data.val_split``, `validation_sources`); otherwise validation reads
    ``data.path``'s, as a run of one dataset always has."""
    return bool(cfg.train.eval_every) and sum(s.task == "text" for s in cfg.data.sources) > 1


@dataclass(frozen=True)
class ValSource:
    """A text source of the mixture validated on its own ``data.val_split`` (``val/<label>/loss``)."""

    label: str
    key: str
    """The config key that declares it (``data.sources[i]``)."""
    path: str
    bucket: tuple[int, int | None] = (0, None)
    """The source's length bucket, when its val split's manifest records the length histogram that selects it
    exactly (then validation reads only that bucket's documents); ``(0, None)``: the whole val split."""
    spanning: dict[int, int] = field(default_factory=dict)
    """The val split's documents across shards (``length_histogram.spanning_documents``), for the bucket."""


def validation_sources(cfg: TrainConfig, mixture: Mixture) -> tuple[list[ValSource], list[str]]:
    """The text sources of a mixture validated one by one (`per_source_validation`), and a line per thing to warn
    about: a source whose dataset has no (or an empty) ``data.val_split`` is left out of validation, and so is one
    whose bucket holds less than a sequence of that split; a bucketed source whose manifest has no length histogram
    of that split is validated on the whole split. A remote source is kept unchecked (its split is read when the
    first validation runs). Retrieval sources have no validation of their own (they are synthetic; the far-recall
    metrics measure them).

    Raises:
        ConfigError: a source's val split is not the one data prep wrote (`split_mismatch`), naming the source's
            key; or no text source has a validation split.
    """
    split = cfg.data.val_split
    kept: list[ValSource] = []
    warnings: list[str] = []
    left_out: list[str] = []
    for s in mixture.sources:
        if s.task != "text":
            continue
        assert s.path is not None
        if is_remote(s.path):
            kept.append(ValSource(s.label, s.key, s.path))
            continue
        root = Path(s.path)
        try:
            manifest = fmt.read_manifest(root)
        except (OSError, ValueError, fmt.IncompleteDatasetError) as err:
            raise ConfigError(f"{s.key}.path={root}: {str(err).splitlines()[0]}") from None
        problem = split_mismatch(root, split, manifest)
        if problem is not None:
            raise ConfigError(
                f"{s.key}.path={root} (data.val_split={split}): {problem}; re-run data prep, or restore the split it "
                "wrote"
            )
        found = _index_samples(root, split)
        if not found:
            what = "has no" if found is None else "has an empty"
            left_out.append(f"{s.key} ({s.label}): {root} {what} validation split '{split}'")
            continue
        if s.bucket == (0, None):
            kept.append(ValSource(s.label, s.key, s.path))
            continue
        stats = manifest.splits.get(split)
        histogram = None if stats is None else stats.length_histogram
        if histogram is None:
            warnings.append(
                f"{s.key} ({s.label}) is validated on its whole '{split}' split, not only its length bucket: "
                f"{root / fmt.MANIFEST_FILENAME} records no length histogram of that split"
            )
            kept.append(ValSource(s.label, s.key, s.path))
            continue
        documents, tokens = fmt.bucket_tokens(histogram, s.bucket[0], s.bucket[1])
        if tokens + documents < cfg.train.seq_len:
            left_out.append(
                f"{s.key} ({s.label}): the '{split}' split of {root} holds {tokens + documents} tokens in its length "
                f"bucket, less than one sequence of train.seq_len={cfg.train.seq_len}"
            )
            continue
        spanning = histogram.spanning_lengths()
        kept.append(ValSource(s.label, s.key, s.path, s.bucket, spanning))
    if not kept:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} but no text source of data.sources has a validation split "
            f"'{split}' (data.val_split): {'; '.join(left_out)}; set train.eval_every=0, or prepare the data with a "
            "larger val_fraction / more documents"
        )
    return kept, warnings + [f"{line}: left out of validation" for line in left_out]


def resolve_document_eos(cfg: TrainConfig) -> None:
    """``model.retrieval_scope=document``: set ``model.eos_id`` to the end-of-document token the dataset's packing
    joins between documents (the manifest's), or check the one the user set against it.

    Raises:
        ConfigError: the dataset records no such token, or ``model.eos_id`` names another one.
    """
    m = cfg.model
    if m.retrieval_scope != "document":
        return
    try:
        dataset_eos = eos_id_of(cfg.data.path)
    except fmt.IncompleteDatasetError as err:
        raise ConfigError(str(err)) from None
    if dataset_eos is None:
        raise ConfigError(
            f"model.retrieval_scope=document needs the end-of-document token between packed documents, and "
            f"data.path={cfg.data.path} has none (a remote dataset is packed without one; a local one needs the "
            "manifest data prep writes, with a tokenizer eos_id): prepare the data with make prep, or use "
            "model.retrieval_scope=sequence"
        )
    if m.eos_id is None:
        m.eos_id = dataset_eos
    elif m.eos_id != dataset_eos:
        raise ConfigError(
            f"model.eos_id={m.eos_id} but the dataset {cfg.data.path} separates documents with token {dataset_eos}; "
            f"leave model.eos_id unset (it is taken from the dataset) or set model.eos_id={dataset_eos}"
        )


def check_inputs(cfg: TrainConfig) -> None:
    """Everything about the inputs that can be checked before any work starts (no process group, no output).

    Raises:
        ConfigError: naming the key, file or value and the fix.
    """
    if not is_remote(cfg.data.path):  # a remote dataset is checked as its shards arrive
        if not Path(cfg.data.path).is_dir():
            raise ConfigError(
                f"data.path={cfg.data.path} is not a directory; run make prep (or launch/prep.py) "
                "and point data.path at its output"
            )
        try:
            refuse_prep_work_dir(cfg.data.path)
        except fmt.IncompleteDatasetError as err:
            raise ConfigError(str(err)) from None
        manifest = _read_manifest(Path(cfg.data.path))
        if manifest is None:
            _check_is_dataset(cfg)
        _check_tokenizer(cfg, manifest)
        _check_splits(cfg, manifest)
        resolve_document_eos(cfg)
    mixture = check_mixture(cfg)
    if per_source_validation(cfg):
        for line in validation_sources(cfg, mixture)[1]:
            log.warning("validation: %s", line)
    _check_dense_weights(cfg)
    if cfg.logging.wandb:
        try:
            resolve_wandb_mode(cfg.logging.wandb_mode, os.environ)
        except ValueError as err:
            raise ConfigError(f"logging.wandb_mode=auto reads WANDB_MODE, and {err}") from None
        refusal = online_refusal(cfg.logging.wandb_mode, os.environ)  # wandb.init would hang ~90 s, or raise
        if refusal is not None:
            raise ConfigError(refusal)
    foreign = foreign_leftovers(cfg.run_dir)
    if foreign:
        raise ConfigError(
            f"{foreign[0]} is not a committed checkpoint and was not written by this trainer (no "
            f"{OWNER_FILE}), so it is never deleted; move it out of {foreign[0].parent} and relaunch"
            + (f" ({len(foreign) - 1} more like it)" if len(foreign) > 1 else "")
        )


def _check_dense_tokenizer(cfg: TrainConfig, dataset: TokenizerFiles | None) -> None:
    """``checkpoint.init_from=hf:<dir>``: the dataset must be tokenized with the dense model's tokenizer, or the
    converted model reads ids that mean other text. The folder's tokenizer file of the dataset's kind
    (``tokenizer.model`` for a SentencePiece dataset, ``tokenizer.json`` for a Hugging Face one) must be the dataset's
    byte for byte; a folder with only the other kind cannot match. A folder or dataset without a tokenizer cannot be
    checked (logged)."""
    init_from = cfg.checkpoint.init_from
    if init_from is None or not init_from.startswith(HF_INIT_PREFIX):
        return
    dense = Path(init_from[len(HF_INIT_PREFIX) :])
    try:
        theirs = folder_tokenizer(dense, dataset.kind if dataset is not None else None) or folder_tokenizer(dense)
    except UnsafeDatasetError as err:  # not a regular file, or unreadable: named
        raise ConfigError(f"checkpoint.init_from={init_from}: {err}") from None
    if theirs is None:
        log.warning("%s holds no tokenizer: cannot check that data.path was tokenized with the dense model's", dense)
        return
    if dataset is None:
        log.warning("data.path has no tokenizer: cannot check it was tokenized with %s", dense / theirs.name)
        return
    if theirs.kind != dataset.kind or theirs.data != dataset.data:
        raise ConfigError(
            f"data.path={cfg.data.path} was tokenized with another tokenizer ({dataset.name}, sha256 "
            f"{dataset.sha256[:12]}) than the dense model of checkpoint.init_from={init_from} ({theirs.name}, sha256 "
            f"{theirs.sha256[:12]}); prepare the data with {_prep_keys(dense, theirs)}"
        )


def _check_dense_weights(cfg: TrainConfig) -> None:
    """``checkpoint.init_from=hf:<dir>``: the folder's weight files, and its ``model.safetensors.index.json`` when it
    has one, are checked (`model.convert.weight_files`: names inside the folder, regular files) before any work,
    not when the model is built."""
    init_from = cfg.checkpoint.init_from
    if init_from is None or not init_from.startswith(HF_INIT_PREFIX):
        return
    try:
        weight_files(Path(init_from[len(HF_INIT_PREFIX) :]))
    except ConversionError as err:
        raise ConfigError(f"checkpoint.init_from={init_from}: {err}") from None


def _prep_keys(dense: Path, tokenizer: TokenizerFiles) -> str:
    """The prep overrides that tokenize with the dense model's own tokenizer."""
    if tokenizer.kind == HF:
        return f"tokenizer.type=hf tokenizer.path={dense}"
    assert tokenizer.kind == SENTENCEPIECE
    return f"tokenizer.model={dense / tokenizer.name}"


def init_weights_from(model: CausalLM, export_dir: str) -> None:
    """Load the weights of an eval export into a freshly built model (``checkpoint.init_from``).

    Raises:
        ConfigError: the export holds another architecture, or tensors that do not fit this model (named).
    """
    from safetensors.torch import load_model

    if export_dir.startswith(HF_INIT_PREFIX):
        convert_dense_weights(model, export_dir)
        return
    weights = Path(export_dir) / "model.safetensors"
    try:
        exported, _ = read_export_config(export_dir)
        check_safetensors(weights)  # a pickle or damaged file is refused by its header, never loaded
    except (ExportError, FileNotFoundError) as exc:
        raise ConfigError(f"checkpoint.init_from: {exc}") from None
    if exported.arch != model.cfg.arch:
        raise ConfigError(
            f"checkpoint.init_from={export_dir!r} holds a model.arch={exported.arch!r} model; "
            f"this run builds model.arch={model.cfg.arch!r}"
        )
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise ConfigError(f"checkpoint.init_from: {weights} does not fit model.*: {exc}") from exc
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint.init_from: {weights} does not fit model.*: missing tensors "
            f"{sorted(missing)}, unexpected tensors {sorted(unexpected)}"
        )
    _refuse_non_finite(model, weights)
    log.info("initial weights from %s", weights)


def convert_dense_weights(model: CausalLM, init_from: str) -> None:
    """``checkpoint.init_from=hf:<dir>``: every weight of ``model`` from a dense checkpoint (``model/convert.py``).

    Raises:
        ConfigError: the checkpoint does not convert into this model (the message names the key or tensor).
    """
    directory = init_from[len(HF_INIT_PREFIX) :]
    if not isinstance(model, GCAForCausalLM):
        raise ConfigError(f"checkpoint.init_from={init_from!r} converts into model.arch=gca; got {model.cfg.arch}")
    try:
        source = convert_dense_into(model, directory)
    except ConversionError as err:
        raise ConfigError(f"checkpoint.init_from={init_from!r}: {err}") from None
    _refuse_non_finite(model, directory)
    new = sum(origin.startswith("new") for origin in source.values())
    log.info(
        "initial weights converted from the dense checkpoint %s (%d GCA tensors, %d new)", directory, len(source), new
    )


def _refuse_non_finite(model: CausalLM, source: str | Path) -> None:
    """A NaN or infinite initial weight would make the first step's loss NaN, reported as a training failure far
    from its cause; refused here, before the engine is built or anything is written."""
    try:
        check_finite_weights(source, model)
    except ExportError as exc:
        raise ConfigError(f"checkpoint.init_from: {exc}") from None

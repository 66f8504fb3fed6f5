"""Parallel prep: one shared tokenizer, ``num_slices`` independent slice runs, then one merged dataset.

A corpus too large for one prep process is prepared in three steps (``launch/slurm/prep.sbatch`` runs them as
a job, a job array and a dependent job; ``launch/slurm/prep_slices.py`` is the CLI)::

    prepare_tokenizer(cfg)           -> <output>.slices/tokenizer.model     (trained on a sample of ALL inputs)
    shard.main(cfg + num_slices=N, slice_index=i, tokenizer.model=<that>, output=<output>.slices/slice-0000i)
    merge_slices(cfg, N)             -> <output>                            (the usual dataset layout)

The merge never rewrites a shard: each slice's MDS shards are hard-linked (copied across file systems) into the
merged split under new consecutive names, and the split's ``index.json`` lists the slices' shard entries in
slice order with the new basenames. As slices are contiguous runs of the input files and document ids are
``ordinal * N + i`` (see `PrepConfig.slice_index`), the merged splits hold the same samples in the same order
as a single prep run with the same tokenizer; only the document ids and the shard boundaries differ.

Like `data_prep.shard.main`, the merge builds a hidden temporary sibling, writes ``manifest.json`` and then
``_COMPLETE`` last, and renames the directory into place; the slices are deleted only after that.
"""

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from data_prep.config import PrepConfig, to_container
from data_prep.errors import ConfigError, InputError, OutputExistsError
from data_prep.format import (
    FORMAT_VERSION,
    SPLITS,
    TOKENIZER_FILENAME,
    IncompleteDatasetError,
    Manifest,
    SplitStats,
    read_manifest,
)
from data_prep.safe_files import INDEX_FILENAME, open_regular, read_index, read_regular, stat_regular
from data_prep.shard import _fsync_write, _tokenizer_model, commit_dataset, select_slice
from data_prep.sources import resolve_sources

logger = logging.getLogger(__name__)

__all__ = ["merge_slices", "prepare_tokenizer", "slice_dir", "slices_root"]

_SHARD_NAME = re.compile(r"shard\.\d+(\.mds(?:\.[A-Za-z0-9]+)?)")
"""MDSWriter's shard basenames: ``shard.00012.mds`` (raw) and ``shard.00012.mds.zstd`` (compressed)."""
_CONTENT_KEYS = ("format", "text_field", "hf", "val_fraction", "split_seed", "max_piece_tokens", "min_tokens", "strict")
"""Config keys that change what a slice holds; every slice must agree with the merge's config on them (the input
files are compared separately, as resolved paths)."""


def slices_root(cfg: PrepConfig) -> Path:
    """Working directory of a sliced run: the shared tokenizer and one sub-directory per slice."""
    out = Path(cfg.output).absolute()
    return out.with_name(out.name + ".slices")


def slice_dir(cfg: PrepConfig, index: int) -> Path:
    """Output directory of slice ``index`` (what its array task passes as ``output=``)."""
    return slices_root(cfg) / f"slice-{index:05d}"


def prepare_tokenizer(cfg: PrepConfig, num_slices: int = 1) -> Path:
    """Write the tokenizer every slice will use to ``<output>.slices/tokenizer.model`` and return its path.

    With ``tokenizer.vocab_size`` a model is trained on a sample of all inputs, exactly as a single prep run
    would train it; with ``tokenizer.model`` that model is checked and copied.

    Args:
        cfg: the config of the sliced run as the user wrote it.
        num_slices: the number of slices that will follow, checked against the input files before any work.

    Raises:
        OutputExistsError: the output exists, or an earlier sliced run left ``<output>.slices`` (unless
            ``overwrite=true``, which removes those slices).
        ConfigError: more slices than input files, or as in `data_prep.shard.main`.
        InputError: as in `data_prep.shard.main`.
    """
    out, root = Path(cfg.output).absolute(), slices_root(cfg)
    if out.exists() and not cfg.overwrite:
        raise OutputExistsError(f"output {out} already exists; pass overwrite=true to replace it")
    if root.exists():
        if not cfg.overwrite:
            raise OutputExistsError(
                f"{root} holds slices of an earlier run: rerun only the failed array tasks and the merge, or pass "
                "overwrite=true to start over"
            )
        logger.warning("overwrite=true: removing the slices of an earlier run in %s", root)
        shutil.rmtree(root)
    sources = resolve_sources(cfg)
    select_slice(sources, dataclasses.replace(cfg, num_slices=num_slices))  # fail now, not in every array task
    model_proto, trained = _tokenizer_model(sources, cfg)
    root.mkdir(parents=True)
    path = root / TOKENIZER_FILENAME
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _fsync_write(tmp, model_proto)
    tmp.rename(path)
    logger.info("%s shared tokenizer %s (sha256 %s)", "trained" if trained else "copied", path,
                hashlib.sha256(model_proto).hexdigest()[:16])  # fmt: skip
    return path


def _check_slice(cfg: PrepConfig, index: int, num_slices: int, manifest: Manifest, tokenizer_sha: str) -> None:
    name = slice_dir(cfg, index).name
    got = manifest.config
    if (got.get("num_slices"), got.get("slice_index")) != (num_slices, index):
        raise InputError(f"{name} was prepared as slice {got.get('slice_index')} of {got.get('num_slices')}, "
                         f"expected slice {index} of {num_slices}")  # fmt: skip
    want = to_container(cfg)
    for key in _CONTENT_KEYS:
        if got.get(key) != want[key]:
            raise InputError(f"{name} was prepared with {key}={got.get(key)!r} but the config says {want[key]!r}; "
                             "rerun that slice")  # fmt: skip
    if manifest.tokenizer.sha256 != tokenizer_sha:
        raise InputError(f"{name} was tokenized with a different tokenizer (sha256 {manifest.tokenizer.sha256[:16]}, "
                         f"shared model {tokenizer_sha[:16]}); rerun that slice")  # fmt: skip


def _link(src_dir: Path, name: str, dst: Path) -> None:
    """Hard-link (else copy) the regular file ``src_dir/name`` to ``dst``. The link is made to the file itself,
    never through a symbolic link, and what landed in ``dst`` is checked again, so a file swapped for a link
    after `stat_regular` is refused too. Sharing the inode is safe: no reader writes into a dataset."""
    try:
        os.link(src_dir / name, dst, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        with os.fdopen(open_regular(src_dir, name), "rb") as f:
            _fsync_write(dst, f.read())
        return
    stat_regular(dst.parent, dst.name)


def _merge_split(sources: list[Path], dst: Path) -> int:
    """Link every shard of ``sources`` (split directories, in order) into ``dst``; return the shard count."""
    dst.mkdir()
    entries: list[dict[str, Any]] = []
    layout: tuple[Any, ...] | None = None
    for src in sources:
        for entry in read_index(src)[0]["shards"]:  # checked: plain names inside src, MDS, no pickle
            this = (entry["column_names"], entry["column_encodings"], entry["format"])
            if layout is not None and this != layout:
                raise InputError(f"{src} has columns {this}, earlier slices have {layout}")
            layout = this
            number = len(entries)
            linked = 0
            for key in ("raw_data", "zip_data"):
                data = entry.get(key)
                if data is None:
                    continue
                match = _SHARD_NAME.fullmatch(data["basename"])
                if match is None:  # never follow a path out of the split directory
                    raise InputError(f"{src / INDEX_FILENAME}: unexpected shard name {data['basename']!r}")
                name = f"shard.{number:05d}{match.group(1)}"
                # Older versions read splits in place, decompressing them and dropping the zip: either may be gone.
                if stat_regular(src, data["basename"]) is not None:
                    _link(src, data["basename"], dst / name)
                    linked += 1
                data["basename"] = name
            if not linked:
                raise InputError(f"{src}: shard {entry['raw_data']['basename']} is listed in index.json but missing")
            entries.append(entry)
    # Written like MDSWriter writes it; the trainer and StreamingDataset read only this file.
    _fsync_write(dst / INDEX_FILENAME, json.dumps({"version": 2, "shards": entries}, sort_keys=True).encode())
    return len(entries)


def merge_slices(cfg: PrepConfig, num_slices: int, keep_slices: bool = False) -> Manifest:
    """Merge ``<output>.slices/slice-*`` into ``cfg.output`` (see the module docstring).

    Args:
        cfg: the config of the sliced run as the user wrote it (without the per-slice overrides).
        num_slices: how many slices the array prepared; every one must be complete.
        keep_slices: keep ``<output>.slices`` after the merge (it holds no extra disk space beyond the
            hard links while both exist).

    Returns:
        The merged dataset's manifest.

    Raises:
        IncompleteDatasetError: a slice is missing or unfinished (its array task failed or is still running).
        InputError: a slice was prepared with other settings, another tokenizer or other input files.
        OutputExistsError: the output exists and ``overwrite`` is false.
    """
    out, root = Path(cfg.output).absolute(), slices_root(cfg)
    if out.exists() and not cfg.overwrite:
        raise OutputExistsError(f"output {out} already exists; pass overwrite=true to replace it")
    if num_slices < 1:
        raise ConfigError(f"num_slices must be at least 1, got {num_slices}")
    if stat_regular(root, TOKENIZER_FILENAME) is None:
        raise IncompleteDatasetError(f"{root / TOKENIZER_FILENAME} is missing: run the tokenizer step first")
    tokenizer = read_regular(root, TOKENIZER_FILENAME)
    tokenizer_sha = hashlib.sha256(tokenizer).hexdigest()
    all_sources = resolve_sources(cfg)
    manifests: dict[int, Manifest] = {}
    for index in range(num_slices):
        try:
            manifests[index] = read_manifest(slice_dir(cfg, index))
        except IncompleteDatasetError:
            pass
    missing = [i for i in range(num_slices) if i not in manifests]
    if missing:
        raise IncompleteDatasetError(
            f"slices {','.join(map(str, missing))} of {num_slices} in {root} are missing or unfinished: their array "
            "tasks failed or have not run; rerun those tasks, then the merge")  # fmt: skip
    for index, manifest in manifests.items():
        _check_slice(cfg, index, num_slices, manifest, tokenizer_sha)
        sliced = dataclasses.replace(cfg, num_slices=num_slices, slice_index=index)
        expected = [s.fingerprint(content=False).path for s in select_slice(all_sources, sliced)]
        if [i.path for i in manifest.inputs] != expected:
            raise InputError(f"{slice_dir(cfg, index).name} covers other input files than the current input list; "
                             "rerun that slice")  # fmt: skip
    dtypes = {m.token_dtype for m in manifests.values()}
    if len(dtypes) != 1:
        raise InputError(f"slices disagree on the token dtype: {sorted(dtypes)}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        _fsync_write(tmp / TOKENIZER_FILENAME, tokenizer)
        splits: dict[str, SplitStats] = {}
        for split in SPLITS:
            shards = _merge_split([slice_dir(cfg, i) / split for i in range(num_slices)], tmp / split)
            stats = [m.splits[split] for m in manifests.values()]
            index_sha = hashlib.sha256((tmp / split / INDEX_FILENAME).read_bytes()).hexdigest()
            splits[split] = SplitStats(documents=sum(s.documents for s in stats), pieces=sum(s.pieces for s in stats),
                                       tokens=sum(s.tokens for s in stats), index_sha256=index_sha)  # fmt: skip
            logger.info("%s: %d shards from %d slices", split, shards, num_slices)
        skipped: Counter[str] = Counter()
        for m in manifests.values():
            skipped.update(m.skipped)
        if any(m.software != manifests[0].software for m in manifests.values()):
            logger.warning("slices were written with different software versions: %s",
                           sorted({json.dumps(m.software, sort_keys=True) for m in manifests.values()}))  # fmt: skip
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            token_dtype=manifests[0].token_dtype,
            tokenizer=dataclasses.replace(manifests[0].tokenizer, trained=cfg.tokenizer.model is None),
            splits=splits,
            skipped=dict(sorted(skipped.items())),
            inputs=[i for m in manifests.values() for i in m.inputs],
            config=to_container(dataclasses.replace(cfg, num_slices=num_slices)),
            software=manifests[0].software,
        )
        commit_dataset(tmp, out, manifest, cfg.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not keep_slices:
        shutil.rmtree(root)
    logger.info("merged %d slices into %s: train %d docs / %d tokens, val %d docs / %d tokens", num_slices, out,
                splits["train"].documents, splits["train"].tokens, splits["val"].documents,
                splits["val"].tokens)  # fmt: skip
    return manifest

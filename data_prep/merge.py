"""Parallel prep: one shared tokenizer, ``num_slices`` independent slice runs, then one merged dataset.

A corpus too large for one prep process is prepared in three steps (``launch/slurm/prep.sbatch`` runs them as
a job, a job array and a dependent job; ``launch/slurm/prep_slices.py`` is the CLI)::

    prepare_tokenizer(cfg)           -> <output>.slices/tokenizer.model   (trained on a sample of ALL inputs)
                                     or <output>.slices/tokenizer.json    (tokenizer.type=hf: copied, with its
                                                                           tokenizer_config.json when it has one)
    shard.main(cfg + slice_overrides(cfg, N, i))                          (that tokenizer; <output>.slices/slice-0000i)
    merge_slices(cfg, N)             -> <output>                          (the usual dataset layout)

The merge never rewrites a shard: each slice's MDS shards are hard-linked (copied across file systems) into the
merged split under new consecutive names, and the split's ``index.json`` lists the slices' shard entries in
slice order with the new basenames. As slices are contiguous runs of the input files and document ids are
``ordinal * N + i`` (see `PrepConfig.slice_index`), the merged splits hold the same samples in the same order
as a single prep run with the same tokenizer; only the document ids and the shard boundaries differ.

A split that no document of a slice reached is not written in that slice (see `data_prep.format`); the merge
skips it there, and a split empty in every slice is absent from the merged dataset too, as in a single run. Every
slice's manifest must name the shared tokenizer (type, sha256 and, for ``tokenizer.type=hf``, the sha256 of
``tokenizer_config.json``); the merged dataset carries the shared files and the manifest fields a single run writes.

Like `data_prep.shard.main`, the merge checks the output before any work, builds a hidden, marked temporary
sibling, writes ``manifest.json`` and then ``_COMPLETE`` last, and renames the directory into place; the slices
are deleted only after that. Deleting is limited to what provably is prep's: ``<output>.slices`` carries a marker
from the tokenizer step that created it, and inside it only the shared tokenizer, complete slice datasets and
marked work directories are removed; anything else is left where it is, naming the path.
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
from data_prep.dataset_tokenizer import TokenizerFiles, read_tokenizer_files
from data_prep.errors import ConfigError, InputError, OutputExistsError, OutputWriteError, PrepError
from data_prep.format import (
    EMPTY_SPLIT_SHA256,
    FORMAT_VERSION,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILENAMES,
    HF_TOKENIZER_JSON,
    SPLITS,
    TOKENIZER_FILENAME,
    IncompleteDatasetError,
    LengthHistogram,
    Manifest,
    SplitStats,
    read_manifest,
)
from data_prep.safe_files import INDEX_FILENAME, open_regular, read_index, stat_regular
from data_prep.safe_write import write_bytes
from data_prep.shard import (
    check_output,
    commit_dataset,
    dataset_paths,
    delete_dataset,
    is_plain_file,
    is_work_dir,
    make_work_dir,
    prep_tokenizer,
    remove_stale_work_dirs,
    select_slice,
)
from data_prep.sources import resolve_sources
from data_prep.split import val_split, why_val_is_empty

logger = logging.getLogger(__name__)

__all__ = ["merge_slices", "prepare_tokenizer", "slice_dir", "slice_overrides", "slices_root"]

_SHARD_NAME = re.compile(r"shard\.\d+(\.mds(?:\.[A-Za-z0-9]+)?)")
"""MDSWriter's shard basenames: ``shard.00012.mds`` (raw) and ``shard.00012.mds.zstd`` (compressed)."""
_CONTENT_KEYS = (
    "format",
    "text_field",
    "hf",
    "val_fraction",
    "val_unit",
    "split_seed",
    "max_piece_tokens",
    "min_tokens",
    "strict",
    "exclude",
)
"""Config keys that change what a slice holds; every slice must agree with the merge's config on them (the input
files are compared separately, as resolved paths)."""
_SLICES_MARKER = ".prep-slices"
"""Empty file the tokenizer step creates in ``<output>.slices`` right after the directory: proof that the directory
is prep's, so ``overwrite=true`` and the merge may delete what a sliced run writes in it."""
_SLICE_NAME = re.compile(r"slice-\d{5,}")
_SLICE_OLD = re.compile(r"\.slice-\d{5,}\.old-\d+")
"""A slice dataset moved aside while a rerun of its task replaced it (``overwrite=true``)."""
_SLICE_WORK = re.compile(r"\.slice-\d{5,}\.tmp-\d+")
"""The work directory of a slice task that was killed; prep marks every work directory it creates."""
_SHARED_TOKENIZER_FILES = (TOKENIZER_FILENAME, *HF_TOKENIZER_FILENAMES)
"""What the tokenizer step may write: ``tokenizer.model``, or ``tokenizer.json`` and maybe ``tokenizer_config.json``."""
_TOKENIZER_WORK = re.compile(r"\.(?:" + "|".join(map(re.escape, _SHARED_TOKENIZER_FILES)) + r")\.tmp-\d+")
"""A shared tokenizer file of a tokenizer step killed while writing it."""


def slices_root(cfg: PrepConfig) -> Path:
    """Working directory of a sliced run: the shared tokenizer and one sub-directory per slice."""
    out = Path(cfg.output).absolute()
    return out.with_name(out.name + ".slices")


def slice_dir(cfg: PrepConfig, index: int) -> Path:
    """Output directory of slice ``index`` (what its array task passes as ``output=``)."""
    return slices_root(cfg) / f"slice-{index:05d}"


def _shared_name(cfg: PrepConfig) -> str:
    """The shared tokenizer's own file in ``<output>.slices``: ``tokenizer.json`` for ``tokenizer.type=hf``."""
    return HF_TOKENIZER_JSON if cfg.tokenizer.type == "hf" else TOKENIZER_FILENAME


def slice_overrides(cfg: PrepConfig, num_slices: int, index: int) -> list[str]:
    """The ``key=value`` overrides that make the sliced run's config the config of slice ``index`` (what its array
    task runs): its output, its place among the slices, and the shared tokenizer in place of the user's, so every
    slice encodes with the very bytes the merge checks."""
    root = slices_root(cfg)
    if cfg.tokenizer.type == "hf":
        shared = [f"tokenizer.path={root}"]  # read_folder takes tokenizer.json (+ tokenizer_config.json) from there
    else:
        shared = [f"tokenizer.model={root / TOKENIZER_FILENAME}", "tokenizer.vocab_size=null"]
    return [f"output={slice_dir(cfg, index)}", f"num_slices={num_slices}", f"slice_index={index}", *shared]


def _is_prep_dataset(path: Path) -> bool:
    """Whether ``path`` is a complete dataset prep wrote, holding nothing else (what `delete_dataset` deletes)."""
    try:
        dataset_paths(path)
    except OutputExistsError:
        return False
    return True


def _written_by_slicing(entry: Path) -> bool:
    """Whether ``entry`` of a marked slices directory is something the steps of a sliced run write there."""
    name = entry.name
    if name == _SLICES_MARKER or name in _SHARED_TOKENIZER_FILES or _TOKENIZER_WORK.fullmatch(name):
        return is_plain_file(entry)
    if _SLICE_NAME.fullmatch(name) or _SLICE_OLD.fullmatch(name):
        return _is_prep_dataset(entry)
    return _SLICE_WORK.fullmatch(name) is not None and is_work_dir(entry)


def _slices_contents(root: Path) -> tuple[list[Path], list[Path]]:
    """(entries of the slices directory ``root`` a sliced run wrote, all other entries).

    Raises:
        OutputExistsError: ``root`` is a link or a file, or it lacks the marker of the tokenizer step that
            creates it (so it is not provably prep's).
    """
    if root.is_symlink() or not root.is_dir():
        raise OutputExistsError(
            f"{root} is not a directory (a file or a symbolic link) but is named like the "
            "slices of this output; nothing was deleted: remove or move it yourself"
        )
    marker = root / _SLICES_MARKER
    if not os.path.lexists(marker) or not is_plain_file(marker):
        raise OutputExistsError(
            f"{root} has no {_SLICES_MARKER} marker, so the tokenizer step of a sliced run did not "
            "create it; nothing was deleted: remove or move it yourself, or choose another "
            "output"
        )
    ours: list[Path] = []
    other: list[Path] = []
    for entry in sorted(root.iterdir()):
        (ours if _written_by_slicing(entry) else other).append(entry)
    return ours, other


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths[:5]) + (" ..." if len(paths) > 5 else "")


def _delete_slices(root: Path, ours: list[Path], other: list[Path]) -> None:
    """Delete the entries ``ours`` of the slices directory ``root``, then the marker and ``root`` itself unless
    ``other`` entries (not prep's) remain: those are left in place, and so is the marker that recognises ``root``."""
    for entry in ours:
        if entry.name == _SLICES_MARKER:
            continue
        if _SLICE_WORK.fullmatch(entry.name):
            shutil.rmtree(entry)  # a marked work directory: all of it is prep's
        elif is_plain_file(entry):
            entry.unlink()
        else:
            delete_dataset(entry)  # checked again and deleted file by file, never through a link
    if other:
        logger.warning("left %s in %s: not written by the sliced run; remove them yourself", _names(other), root)
        return
    left = [p for p in root.iterdir() if p.name != _SLICES_MARKER]
    if left:  # a slice that `delete_dataset` could not remove (it warned): keep the marker that recognises it
        logger.warning("could not fully remove %s (%s remain); remove it by hand", root, _names(left))
        return
    (root / _SLICES_MARKER).unlink()
    root.rmdir()


def _make_slices_root(root: Path) -> None:
    """Create ``root`` and its marker (see `_SLICES_MARKER`) right after it."""
    try:
        root.mkdir(parents=True)
        write_bytes(root / _SLICES_MARKER, b"")
    except OSError as exc:
        raise OutputWriteError(
            f"cannot create {exc.filename or root} ({exc.strerror or exc}): the slices need a "
            "writable directory next to the output; fix its permissions or choose another "
            "output"
        ) from None


def _write_shared_tokenizer(root: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``root``, each through a temporary file renamed into place. ``tokenizer_config.json`` goes
    first: the tokenizer file itself, renamed last, is what the slices and the merge take as the finished step."""
    for name in sorted(files, key=lambda n: n != HF_TOKENIZER_CONFIG):
        write_bytes(root / name, files[name], fsync=True)


def prepare_tokenizer(cfg: PrepConfig, num_slices: int = 1) -> Path:
    """Write the tokenizer every slice will use into ``<output>.slices/`` and return the path of its file
    (``tokenizer.model``, or ``tokenizer.json`` for ``tokenizer.type=hf``).

    With ``tokenizer.vocab_size`` a model is trained on a sample of all inputs, exactly as a single prep run
    would train it; with ``tokenizer.model`` that model is checked and copied; with ``tokenizer.type=hf`` the
    folder's ``tokenizer.json`` (and ``tokenizer_config.json`` when it has one) is checked and loaded as a single run
    does, and copied byte for byte. Every check (output, earlier slices, slice count) runs before the tokenizer is
    trained or read; earlier slices are deleted only after that.

    Args:
        cfg: the config of the sliced run as the user wrote it.
        num_slices: the number of slices that will follow, checked against the input files before any work.

    Raises:
        OutputExistsError: the output exists, or an earlier sliced run left ``<output>.slices`` (unless
            ``overwrite=true``, which removes those slices); ``<output>.slices`` or the output is not provably
            prep's, or holds something prep did not write (nothing is deleted then).
        ConfigError: more slices than input files, an unreadable ``tokenizer.path``, or as in `data_prep.shard.main`.
        InputError: as in `data_prep.shard.main`.
    """
    out, root = Path(cfg.output).absolute(), slices_root(cfg)
    sources = resolve_sources(cfg)
    check_output(out, cfg, sources)
    earlier: tuple[list[Path], list[Path]] | None = None
    if root.exists() or root.is_symlink():
        if not cfg.overwrite:
            raise OutputExistsError(
                f"{root} holds slices of an earlier run: rerun only the failed array tasks and the merge, or pass "
                "overwrite=true to start over"
            )
        earlier = _slices_contents(root)
        if earlier[1]:
            raise OutputExistsError(
                f"{root} holds files a sliced run did not write ({_names(earlier[1])}); nothing "
                "was deleted: remove or move them yourself, or choose another output"
            )
    select_slice(sources, dataclasses.replace(cfg, num_slices=num_slices))  # fail now, not in every array task
    tokenizer = prep_tokenizer(sources, cfg, val_split(sources, cfg))
    if earlier is not None:
        logger.warning("overwrite=true: removing the slices of an earlier run in %s", root)
        _delete_slices(root, *earlier)
    _make_slices_root(root)
    _write_shared_tokenizer(root, tokenizer.files)
    path = root / _shared_name(cfg)
    logger.info(
        "%s shared tokenizer %s (sha256 %s)",
        "trained" if tokenizer.info.trained else "copied",
        path,
        tokenizer.info.sha256[:16],
    )
    return path


def _tokenizer_identity(files: TokenizerFiles) -> tuple[str, str, str]:
    """(type, sha256, config_sha256) as a manifest records them for these files (`data_prep.format.TokenizerInfo`:
    ``config_sha256`` is ``""`` without a ``tokenizer_config.json``)."""
    config_sha = hashlib.sha256(files.config).hexdigest() if files.config is not None else ""
    return files.kind, files.sha256, config_sha


def _identity_text(identity: tuple[str, str, str]) -> str:
    kind, sha, config_sha = identity
    text = f"{kind}, sha256 {sha[:16]}"
    if kind == "hf":
        text += f", {HF_TOKENIZER_CONFIG} sha256 {config_sha[:16]}" if config_sha else f", no {HF_TOKENIZER_CONFIG}"
    return text


def _check_slice(
    cfg: PrepConfig, index: int, num_slices: int, manifest: Manifest, shared: tuple[str, str, str]
) -> None:
    name = slice_dir(cfg, index).name
    got = manifest.config
    if (got.get("num_slices"), got.get("slice_index")) != (num_slices, index):
        raise InputError(
            f"{name} was prepared as slice {got.get('slice_index')} of {got.get('num_slices')}, "
            f"expected slice {index} of {num_slices}"
        )
    want = to_container(cfg)
    for key in _CONTENT_KEYS:
        if got.get(key) != want[key]:
            raise InputError(
                f"{name} was prepared with {key}={got.get(key)!r} but the config says {want[key]!r}; rerun that slice"
            )
    tok = manifest.tokenizer
    used = (tok.type, tok.sha256, tok.config_sha256)
    if used != shared:
        raise InputError(
            f"{name} was tokenized with a different tokenizer ({_identity_text(used)}; the shared one: "
            f"{_identity_text(shared)}); rerun that slice"
        )


def _link(src_dir: Path, name: str, dst: Path) -> None:
    """Hard-link (else copy) the regular file ``src_dir/name`` to ``dst``. The link is made to the file itself,
    never through a symbolic link, and what landed in ``dst`` is checked again, so a file swapped for a link
    after `stat_regular` is refused too. Sharing the inode is safe: no reader writes into a dataset."""
    try:
        os.link(src_dir / name, dst, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        with os.fdopen(open_regular(src_dir, name), "rb") as f:
            write_bytes(dst, f.read(), fsync=True)
        return
    stat_regular(dst.parent, dst.name)


def _merge_split(sources: list[Path], dst: Path) -> int:
    """Link every shard of ``sources`` (split directories with samples, in order) into ``dst``; return the shard
    count."""
    dst.mkdir()
    entries: list[dict[str, Any]] = []
    layout: tuple[Any, ...] | None = None
    for src in sources:
        try:
            index = read_index(src)[0]  # checked: plain names inside src, MDS, no pickle
        except FileNotFoundError:
            raise InputError(
                f"{src / INDEX_FILENAME} is missing, but the slice's manifest records samples in that "
                "split; rerun that slice"
            ) from None
        for entry in index["shards"]:
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
    write_bytes(
        dst / INDEX_FILENAME, json.dumps({"version": 2, "shards": entries}, sort_keys=True).encode(), fsync=True
    )
    return len(entries)


def _merge_splits(cfg: PrepConfig, manifests: dict[int, Manifest], tmp: Path) -> dict[str, SplitStats]:
    """Every split of the slices merged into ``tmp``. Slices where a split is empty have no directory for it and
    are skipped; a split empty in all of them gets no directory either, only empty `SplitStats`."""
    splits: dict[str, SplitStats] = {}
    for split in SPLITS:
        stats = [m.splits[split] for m in manifests.values()]
        present = [slice_dir(cfg, i) / split for i, m in manifests.items() if m.has_split(split)]
        index_sha = EMPTY_SPLIT_SHA256
        if present:
            shards = _merge_split(present, tmp / split)
            index_sha = hashlib.sha256((tmp / split / INDEX_FILENAME).read_bytes()).hexdigest()
            logger.info("%s: %d shards from %d of %d slices", split, shards, len(present), len(manifests))
        splits[split] = SplitStats(
            documents=sum(s.documents for s in stats),
            pieces=sum(s.pieces for s in stats),
            tokens=sum(s.tokens for s in stats),
            index_sha256=index_sha,
            length_histogram=_merged_histogram(split, stats),
        )
    return splits


def _merged_histogram(split: str, stats: list[SplitStats]) -> LengthHistogram | None:
    """The `LengthHistogram` of the merged ``split`` from the slices' (``stats``, in slice order), or None when a
    slice holding documents of it recorded none (written before prep recorded histograms).

    The bins add up: every document lies in one slice (its id, ``ordinal * N + i``, is unique across slices) and
    keeps its id and its length. Its spanning status carries over too: the merge neither renumbers ids nor re-cuts
    shards (each slice's shard files are linked whole, in order), so a document crosses a shard boundary of the
    merged split exactly when it crossed one in its slice, and no new boundary can fall inside a document.
    """
    if any(s.length_histogram is None and s.pieces for s in stats):
        old = [i for i, s in enumerate(stats) if s.length_histogram is None and s.pieces]
        logger.warning(
            "%s: slices %s recorded no length histogram (written by an older prep); the merged manifest has none "
            "for this split (rerun those slices to get one)",
            split,
            ",".join(map(str, old)),
        )
        return None
    histograms = [s.length_histogram for s in stats if s.length_histogram is not None]
    bins = max((len(h.documents) for h in histograms), default=0)
    documents, tokens = [0] * bins, [0] * bins
    spanning: dict[str, int] = {}
    for h in histograms:
        for b, (n, t) in enumerate(zip(h.documents, h.tokens, strict=True)):
            documents[b] += n
            tokens[b] += t
        for doc_id, length in h.spanning_documents.items():
            if doc_id in spanning:  # ids are unique across slices (checked by _check_slices' config check)
                raise InputError(f"document {doc_id} of {split} crosses shards in two slices; rerun the slices")
            spanning[doc_id] = length
    while documents and not documents[-1]:  # slices may carry trailing empty bins; a single run writes none
        documents.pop()
        tokens.pop()
    return LengthHistogram(documents=documents, tokens=tokens, spanning_documents=spanning)


def _read_slices(cfg: PrepConfig, num_slices: int) -> dict[int, Manifest]:
    """The manifest of every slice, in slice order.

    Raises:
        IncompleteDatasetError: naming every slice that is missing or unfinished.
        InputError: a slice's manifest is a link, a FIFO, not JSON or of another format version.
    """
    manifests: dict[int, Manifest] = {}
    for index in range(num_slices):
        try:
            manifests[index] = read_manifest(slice_dir(cfg, index))
        except IncompleteDatasetError:
            pass
        except (ValueError, KeyError, TypeError) as err:  # UnsafeDatasetError is a ValueError and names the file
            raise InputError(f"{slice_dir(cfg, index).name}: {str(err).splitlines()[0]}; rerun that slice") from None
    missing = [i for i in range(num_slices) if i not in manifests]
    if missing:
        raise IncompleteDatasetError(
            f"slices {','.join(map(str, missing))} of {num_slices} in {slices_root(cfg)} are missing or unfinished: "
            "their array tasks failed or have not run; rerun those tasks, then the merge"
        )
    return manifests


def _check_slices(cfg: PrepConfig, manifests: dict[int, Manifest], shared: tuple[str, str, str]) -> None:
    """Every slice was made from its share of the current inputs with these settings, and together they hold
    training documents (a single run refuses a dataset without any)."""
    num_slices = len(manifests)
    all_sources = resolve_sources(cfg)
    for index, manifest in manifests.items():
        _check_slice(cfg, index, num_slices, manifest, shared)
        sliced = dataclasses.replace(cfg, num_slices=num_slices, slice_index=index)
        expected = [s.fingerprint(content=False).path for s in select_slice(all_sources, sliced)]
        if [i.path for i in manifest.inputs] != expected:
            raise InputError(
                f"{slice_dir(cfg, index).name} covers other input files than the current input list; rerun that slice"
            )
    dtypes = {m.token_dtype for m in manifests.values()}
    if len(dtypes) != 1:
        raise InputError(f"slices disagree on the token dtype: {sorted(dtypes)}")
    train, val = (sum(m.splits[split].documents for m in manifests.values()) for split in SPLITS)
    if train == 0:
        raise InputError(
            f"no document of the {num_slices} slices reached the train split ({val} went to val with "
            f"val_fraction={cfg.val_fraction}); nothing was written: add input documents or lower "
            "val_fraction / min_tokens"
        )
    if cfg.val_fraction > 0 and val == 0:
        logger.warning(
            "val split is empty with val_fraction=%s: %s; %s has no val/ directory (manifest: 0 val tokens): add "
            "documents, or train with eval off",
            cfg.val_fraction,
            why_val_is_empty(manifests[0].val_split.unit, cfg.val_fraction),
            cfg.output,
        )


def _merged_manifest(cfg: PrepConfig, manifests: dict[int, Manifest], splits: dict[str, SplitStats]) -> Manifest:
    skipped: Counter[str] = Counter()
    for m in manifests.values():
        skipped.update(m.skipped)
    if any(m.software != manifests[0].software for m in manifests.values()):
        logger.warning(
            "slices were written with different software versions: %s",
            sorted({json.dumps(m.software, sort_keys=True) for m in manifests.values()}),
        )
    return Manifest(
        format_version=FORMAT_VERSION,
        token_dtype=manifests[0].token_dtype,
        # every slice was given the shared tokenizer; it was trained when the sliced run's config asks for that
        tokenizer=dataclasses.replace(manifests[0].tokenizer, trained=cfg.tokenizer.vocab_size is not None),
        splits=splits,
        skipped=dict(sorted(skipped.items())),
        inputs=[i for m in manifests.values() for i in m.inputs],
        config=to_container(dataclasses.replace(cfg, num_slices=len(manifests))),
        software=manifests[0].software,
        val_split=manifests[0].val_split,  # every slice drew it over all inputs (data_prep.split)
    )


def _remove_slices_after_merge(root: Path) -> None:
    """Delete the merged slices; warn (the dataset is in place by now) about anything not provably prep's."""
    try:
        _delete_slices(root, *_slices_contents(root))
    except OutputExistsError as exc:
        logger.warning("the slices were kept: %s", exc)
    except OSError as exc:
        logger.warning("could not fully remove the slices in %s (%s); remove them by hand", root, exc)


def _read_shared_tokenizer(cfg: PrepConfig, root: Path) -> TokenizerFiles:
    """The tokenizer step's files in ``root``, read as regular files only.

    Raises:
        IncompleteDatasetError: the tokenizer step has not (or not fully) run.
        InputError: they are of another type than ``tokenizer.type`` of the merge's config.
        UnsafeDatasetError: a link or FIFO in their place, or both a ``tokenizer.model`` and a ``tokenizer.json``.
    """
    shared = read_tokenizer_files(root)
    if shared is None:
        raise IncompleteDatasetError(f"{root / _shared_name(cfg)} is missing: run the tokenizer step first")
    if shared.kind != cfg.tokenizer.type:
        raise InputError(
            f"{root} holds a shared {shared.name} but the config says tokenizer.type={cfg.tokenizer.type}: merge with "
            "the config the slices were prepared with, or rerun all steps with overwrite=true"
        )
    return shared


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
        InputError: a slice was prepared with other settings, another tokenizer or other input files; no slice
            holds a training document; the shared tokenizer is not of the config's ``tokenizer.type``.
        UnsafeDatasetError: a shared tokenizer file is a link or FIFO, or both kinds are there.
        OutputExistsError: the output exists and ``overwrite`` is false, or it is not a dataset prep wrote.
        ConfigError: an output that holds an input, the working directory or the repository, or is a link.
        OutputWriteError: writing the merged dataset failed; its work directory is removed, the output unchanged.
    """
    out, root = Path(cfg.output).absolute(), slices_root(cfg)
    if num_slices < 1:
        raise ConfigError(f"num_slices must be at least 1, got {num_slices}")
    check_output(out, cfg, resolve_sources(cfg))
    tokenizer = _read_shared_tokenizer(cfg, root)
    manifests = _read_slices(cfg, num_slices)
    _check_slices(cfg, manifests, _tokenizer_identity(tokenizer))
    remove_stale_work_dirs(out)  # a killed merge's marked work directory
    tmp = make_work_dir(out)
    try:
        for name, data in tokenizer.files().items():  # as a single run writes them (data_prep.shard)
            write_bytes(tmp / name, data, fsync=True)
        splits = _merge_splits(cfg, manifests, tmp)
        manifest = _merged_manifest(cfg, manifests, splits)
        commit_dataset(tmp, out, manifest, cfg.overwrite)
    except PrepError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputWriteError(
            f"merging into {tmp} failed at {exc.filename or tmp}: {exc.strerror or exc}; the "
            f"unfinished {tmp.name} was removed and {out} is as it was before the merge"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not keep_slices:
        _remove_slices_after_merge(root)
    logger.info(
        "merged %d slices into %s: train %d docs / %d tokens, val %d docs / %d tokens",
        num_slices,
        out,
        splits["train"].documents,
        splits["train"].tokens,
        splits["val"].documents,
        splits["val"].tokens,
    )
    return manifest

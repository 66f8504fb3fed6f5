"""Sliced prep + merge (``data_prep.merge``): the merged dataset equals a single run with the same tokenizer."""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import hf_test_tokenizer, save_hf_tokenizer

from data_prep.cli import slices_main
from data_prep.config import PrepConfig, load_config
from data_prep.errors import ConfigError, InputError, OutputExistsError
from data_prep.format import EMPTY_SPLIT_SHA256, IncompleteDatasetError, read_manifest
from data_prep.merge import merge_slices, prepare_tokenizer, slice_dir, slice_overrides, slices_root
from data_prep.shard import main as prep_main

REPO = Path(__file__).resolve().parents[2]
SLICES = 3
TRAINED = {"tokenizer.vocab_size": 400}
"""The tokenizer settings of most tests: a SentencePiece model trained by the tokenizer step."""


def _settings(out: Path, corpus_dir: Path, tokenizer: dict[str, object], **extra: object) -> list[str]:
    """The sliced run's overrides as the user writes them (settings as in `run_prep`; no per-slice overrides)."""
    settings = {**tokenizer, "val_fraction": 0.2, "progress": False, "shard_size_bytes": 16384}
    settings.update(extra)
    return [f"output={out}", f"input={json.dumps([str(corpus_dir)])}"] + [f"{k}={v}" for k, v in settings.items()]


def _config(out: Path, corpus_dir: Path, tokenizer: dict[str, object] = TRAINED, **extra: object) -> PrepConfig:
    return load_config(None, _settings(out, corpus_dir, tokenizer, **extra))


def _cli() -> Callable[[list[str]], int]:
    return slices_main  # what launch/slurm/prep_slices.py runs


def _make_slices(
    corpus_dir: Path, out: Path, val_fraction: float = 0.2, tokenizer: dict[str, object] = TRAINED, **extra: object
) -> PrepConfig:
    """The tokenizer step and all slices of a 3-slice run, through the CLI the SLURM array runs."""
    cli = _cli()
    args = _settings(out, corpus_dir, tokenizer, val_fraction=val_fraction, **extra)
    cfg = load_config(None, args)
    assert cli(["tokenizer", *args]) == 0
    for i in range(SLICES):
        assert cli(["slice", "--index", str(i), "--num-slices", str(SLICES), *args]) == 0
    return cfg


@pytest.fixture
def sliced(corpus, tmp_path) -> PrepConfig:
    return _make_slices(corpus[0], tmp_path / "merged")


def _slice_has_val(cfg: PrepConfig, index: int) -> bool:
    """Whether a slice wrote a val split, by its manifest and by the file system (both must agree)."""
    has = read_manifest(slice_dir(cfg, index)).has_split("val")
    assert has == (slice_dir(cfg, index) / "val").exists()
    return has


# val_fraction 0.05: slice 1 (five books) gets no val document, so it has no val/ directory; 0: no slice has one;
# 1e-6: no document hashes into val, so the corpus's lowest hash goes there (data_prep/split.py), found by every
# slice over all inputs: only the slice holding that document has a val/ directory. 0.005: the one document that
# hashes into val is 1.2% of the text, so val_unit=auto holds out the tail of every document, in every slice.
@pytest.mark.parametrize(
    ("val_fraction", "val_slices"),
    [(0.2, [0, 1, 2]), (0.05, [0, 2]), (0.0, []), (1e-6, [2]), (0.005, [0, 1, 2])],
    ids=["val-in-every-slice", "one-slice-without-val", "no-val-anywhere", "lowest-hash-document", "tails"],
)
def test_merge_equals_a_single_run(val_fraction, val_slices, corpus, run_prep, read_split, join_documents, tmp_path):
    sliced = _make_slices(corpus[0], tmp_path / "merged", val_fraction)
    assert [i for i in range(SLICES) if _slice_has_val(sliced, i)] == val_slices
    out = Path(sliced.output)
    shutil.copyfile(slices_root(sliced) / "tokenizer.model", tmp_path / "tok.model")  # the merge deletes the slices
    slice_shards = sum(
        len(json.loads((slice_dir(sliced, i) / "train/index.json").read_text())["shards"]) for i in range(SLICES)
    )
    merged = merge_slices(sliced, SLICES)
    assert not slices_root(sliced).exists()
    single = run_prep(output=tmp_path / "single", tokenizer__model=tmp_path / "tok.model", val_fraction=val_fraction)

    assert read_manifest(out) == merged
    assert merged.tokenizer.trained and merged.tokenizer.sha256 == single.tokenizer.sha256
    assert merged.config["num_slices"] == SLICES and merged.config["tokenizer"]["vocab_size"] == 400
    assert merged.inputs == single.inputs and merged.skipped == single.skipped
    assert len(json.loads((out / "train/index.json").read_text())["shards"]) == slice_shards
    assert merged.has_split("val") == bool(val_slices) == single.has_split("val")
    assert merged.val_split == single.val_split
    assert merged.val_split.lowest_hash_fallback == (val_fraction == 1e-6)
    assert merged.val_split.unit == ("tokens" if val_fraction == 0.005 else "documents")
    for split in ("train", "val"):
        a, b = merged.splits[split], single.splits[split]
        assert (a.documents, a.pieces, a.tokens) == (b.documents, b.pieces, b.tokens), split
        if not single.has_split(split):  # written exactly like a single run writes an empty split: not at all
            assert a == b and a.index_sha256 == EMPTY_SPLIT_SHA256 and a.pieces == 0, a
            assert not (out / split).exists() and not (tmp_path / "single" / split).exists()
            continue
        got, want = read_split(out / split), read_split(tmp_path / "single" / split)
        # The same samples in the same order; only document ids (ordinal * slices + slice) and shard cuts differ.
        assert [s["tokens"].tolist() for s in got] == [s["tokens"].tolist() for s in want], split
        assert [int(s["piece"]) for s in got] == [int(s["piece"]) for s in want], split
        docs = join_documents(got)
        assert len(docs) == a.documents and sum(map(len, docs.values())) == a.tokens
        assert list(docs.values()) == list(join_documents(want).values())
    assert {d % SLICES for d in join_documents(read_split(out / "train"))} == set(range(SLICES))


def test_merge_names_the_missing_slice(sliced):
    (slice_dir(sliced, 1) / "_COMPLETE").unlink()
    with pytest.raises(IncompleteDatasetError, match="slices 1 of 3 in .* are missing or unfinished: their array"):
        merge_slices(sliced, SLICES)
    with pytest.raises(IncompleteDatasetError, match="slices 1,3,4 of 5"):
        merge_slices(sliced, 5)
    assert not Path(sliced.output).exists()


def test_merge_refuses_a_split_the_manifest_promises_but_that_is_gone(sliced):
    shutil.rmtree(slice_dir(sliced, 2) / "val")
    with pytest.raises(
        InputError,
        match=r"slice-00002/val/index.json is missing, but the slice's manifest records "
        "samples in that split; rerun that slice",
    ):
        merge_slices(sliced, SLICES)
    assert not Path(sliced.output).exists() and not any(Path(sliced.output).parent.glob(".merged.tmp-*"))


def test_merge_refuses_slices_without_a_training_document(corpus, tmp_path):
    """As a single run refuses a dataset with an empty train split, so does the merge, before writing anything."""
    sliced = _make_slices(corpus[0], tmp_path / "merged", min_tokens=100000)
    assert all(read_manifest(slice_dir(sliced, i)).splits["train"].documents == 0 for i in range(SLICES))
    with pytest.raises(InputError, match="no document of the 3 slices reached the train split .* nothing was written"):
        merge_slices(sliced, SLICES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.slices"]


def test_merge_cli_reports_one_line(sliced, capsys):
    cli = _cli()
    assert (
        cli(
            [
                "merge",
                "--num-slices",
                "4",
                f"output={sliced.output}",
                f"input={json.dumps(list(sliced.input))}",
                "tokenizer.vocab_size=400",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("prep_slices merge: error: slices 3 of 4 in ")


def test_merge_rejects_slices_made_otherwise(sliced, corpus):
    with pytest.raises(InputError, match="slice-00000 was prepared with val_fraction=0.2 but the config says 0.3"):
        merge_slices(_config(Path(sliced.output), corpus[0], val_fraction=0.3), SLICES)
    with pytest.raises(InputError, match="slice-00000 was prepared as slice 0 of 3, expected slice 0 of 2"):
        merge_slices(sliced, 2)
    with pytest.raises(InputError, match="slice-00000 covers other input files"):
        merge_slices(_config(Path(sliced.output), corpus[0] / "books"), SLICES)
    (slices_root(sliced) / "tokenizer.model").write_bytes(b"another model")
    with pytest.raises(InputError, match="slice-00000 was tokenized with a different tokenizer"):
        merge_slices(sliced, SLICES)
    assert not Path(sliced.output).exists()


def test_tokenizer_step_refuses_leftover_slices(sliced):
    with pytest.raises(OutputExistsError, match="holds slices of an earlier run"):
        prepare_tokenizer(sliced)
    prepare_tokenizer(dataclasses.replace(sliced, overwrite=True))
    # the marker the tokenizer step creates with the directory: what lets a later overwrite or merge delete it
    assert sorted(p.name for p in slices_root(sliced).iterdir()) == [".prep-slices", "tokenizer.model"]


def test_slicing_needs_a_shared_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="num_slices=3 needs a shared tokenizer: set 'tokenizer.model'"):
        load_config(None, [f"output={tmp_path / 'o'}", "input=x", "tokenizer.vocab_size=400", "num_slices=3"])
    model = tmp_path / "m.model"
    model.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"slice_index=2: must be in \[0, num_slices=2\)"):
        load_config(
            None, [f"output={tmp_path / 'o'}", "input=x", f"tokenizer.model={model}", "num_slices=2", "slice_index=2"]
        )


def test_more_slices_than_files(run_prep, corpus, tmp_path):
    model = tmp_path / "m.model"
    model.write_bytes(b"never read: the slice is chosen first")
    with pytest.raises(ConfigError, match="num_slices=40 is more than the 16 input files; use at most 16"):
        run_prep(output=tmp_path / "o", tokenizer__model=model, num_slices=40, slice_index=0)
    with pytest.raises(ConfigError, match="num_slices=17 is more than the 16 input files"):
        prepare_tokenizer(_config(tmp_path / "o", corpus[0]), num_slices=17)
    assert not (tmp_path / "o.slices").exists()


@pytest.mark.parametrize("hostile", ["../../x.mds", "/tmp/gca-merge-abs.mds", "symlink", "fifo"])
def test_merge_refuses_a_hostile_slice_in_one_line(hostile, sliced, tmp_path, capsys):
    """A slice whose index names a file outside its split, or whose shard is a link or a FIFO: the merge CLI
    prints one line naming the file, creates no output, and leaves the link's target and the slice unchanged."""
    split = slice_dir(sliced, 1) / "train"
    index = json.loads((split / "index.json").read_text())
    shard = index["shards"][0]
    victim = tmp_path / "victim.mds"
    victim.write_bytes(content := (split / shard["zip_data"]["basename"]).read_bytes())
    if hostile in ("symlink", "fifo"):
        for key in ("raw_data", "zip_data"):
            (split / shard[key]["basename"]).unlink(missing_ok=True)
        path = split / shard["zip_data"]["basename"]
        path.symlink_to(victim) if hostile == "symlink" else os.mkfifo(path)
        expected = f"{path} is {'a symbolic link' if hostile == 'symlink' else 'a FIFO'}, not a regular file"
    else:
        shard["zip_data"]["basename"] = hostile + ".zstd"
        (split / "index.json").write_text(json.dumps(index))
        expected = f"shard 0 zip_data: shard file name '{hostile}.zstd' is not a plain relative path"
    before = sorted((p.name, p.lstat().st_size) for p in split.iterdir())
    cli = _cli()
    assert (
        cli(
            [
                "merge",
                "--num-slices",
                str(SLICES),
                f"output={sliced.output}",
                f"input={json.dumps(list(sliced.input))}",
                "tokenizer.vocab_size=400",
                "val_fraction=0.2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("prep_slices merge: error: ") and expected in err and err.count("\n") == 1, err
    assert not Path(sliced.output).exists() and not any(Path(sliced.output).parent.glob(".merged.tmp-*"))
    assert sorted((p.name, p.lstat().st_size) for p in split.iterdir()) == before
    assert victim.read_bytes() == content and not Path("/tmp/gca-merge-abs.mds.zstd").exists()


def _tree(root: Path) -> list[tuple[str, int]]:
    """Every path under ``root`` with its size (links not followed): the file system state a refusal must keep."""
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*"))


def test_overwrite_never_deletes_an_unmarked_slices_directory(corpus, tmp_path):
    """``<output>.slices`` that the tokenizer step did not create (no marker): overwrite=true refuses it in one line
    naming it, before training, and deletes nothing."""
    root = tmp_path / "merged.slices"
    (root / "slice-00000").mkdir(parents=True)
    (root / "slice-00000" / "notes.txt").write_text("someone's work")
    (root / "tokenizer.model").write_text("someone's model")
    before = _tree(root)
    cfg = _config(tmp_path / "merged", corpus[0], overwrite="true")
    with pytest.raises(
        OutputExistsError,
        match=f"^{root} has no .prep-slices marker, so the tokenizer step of a "
        "sliced run did not create it; nothing was deleted",
    ):
        prepare_tokenizer(cfg, SLICES)
    assert _tree(root) == before


def test_overwrite_keeps_slices_holding_foreign_files(sliced):
    """A marked slices directory with a file the run did not write: overwrite=true refuses, nothing is deleted."""
    root = slices_root(sliced)
    (root / "slice-00001" / "train" / "mine.txt").write_text("inside a slice")  # the slice is no longer all prep's
    before = _tree(root)
    with pytest.raises(
        OutputExistsError,
        match=rf"^{root} holds files a sliced run did not write \(slice-00001\); "
        "nothing was deleted",
    ):
        prepare_tokenizer(dataclasses.replace(sliced, overwrite=True), SLICES)
    assert _tree(root) == before


def test_merge_deletes_only_what_the_run_wrote(sliced, caplog):
    """After the merge the slices, the shared tokenizer and a killed slice task's marked work directory are gone;
    a file someone put there is left with a warning naming it, and so is the marker that recognises the directory."""
    root = slices_root(sliced)
    (root / "notes.txt").write_text("mine")
    killed = root / ".slice-00001.tmp-999999"
    killed.mkdir()
    (killed / ".prep-work").touch()  # as shard.make_work_dir marks it
    (killed / "tokenizer.model").write_text("half written")
    unmarked = root / ".slice-00002.tmp-999998"
    unmarked.mkdir()
    with caplog.at_level(logging.WARNING, logger="data_prep.merge"):
        merge_slices(sliced, SLICES)
    assert read_manifest(sliced.output).config["num_slices"] == SLICES
    assert sorted(p.name for p in root.iterdir()) == [".prep-slices", ".slice-00002.tmp-999998", "notes.txt"]
    assert (root / "notes.txt").read_text() == "mine"
    assert f"left .slice-00002.tmp-999998, notes.txt in {root}: not written by the sliced run" in caplog.text


def test_merge_keeps_an_unmarked_slices_directory(sliced, caplog):
    """Slices whose directory lost its marker are merged but not deleted: nothing proves the directory is prep's."""
    root = slices_root(sliced)
    (root / ".prep-slices").unlink()
    before = _tree(root)
    with caplog.at_level(logging.WARNING, logger="data_prep.merge"):
        merge_slices(sliced, SLICES)
    assert read_manifest(sliced.output).config["num_slices"] == SLICES
    assert _tree(root) == before
    assert f"the slices were kept: {root} has no .prep-slices marker" in caplog.text


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_merge_work_directories_are_marked_and_only_marked_ones_are_removed(sliced):
    """A killed merge's marked work directory is removed by the next merge; an unmarked directory with a work
    directory's name (this process's own, or a dead one's) is never deleted."""
    out = Path(sliced.output)
    stale = out.with_name(f".merged.tmp-{_dead_pid()}")
    stale.mkdir()
    (stale / ".prep-work").touch()
    foreign = out.with_name(f".merged.tmp-{_dead_pid()}")
    foreign.mkdir()
    (foreign / "mine.txt").write_text("not prep's")
    own = out.with_name(f".merged.tmp-{os.getpid()}")
    own.mkdir()
    (own / "mine.txt").write_text("not prep's")
    with pytest.raises(
        OutputExistsError,
        match=f"^output {own} is named like this run's work directory but was not made by prep; nothing was deleted",
    ):
        merge_slices(sliced, SLICES)
    assert (own / "mine.txt").read_text() == "not prep's" and (foreign / "mine.txt").read_text() == "not prep's"
    assert not out.exists() and all(slice_dir(sliced, i).is_dir() for i in range(SLICES))
    shutil.rmtree(own)
    merge_slices(sliced, SLICES, keep_slices=True)
    assert not stale.exists() and (foreign / "mine.txt").read_text() == "not prep's"
    assert not (out / ".prep-work").exists()  # the work marker is not left in the dataset


def test_merge_checks_the_output_before_any_work(sliced):
    """overwrite=true over a directory prep did not write: one line naming it, before the slices are even read;
    over a merged dataset: replaced, with the same result."""
    out = Path(sliced.output)
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    (slice_dir(sliced, 1) / "_COMPLETE").unlink()  # would fail the merge later, if the output were not checked first
    with pytest.raises(OutputExistsError, match=f"^output {out} exists but is not a complete dataset written by prep"):
        merge_slices(dataclasses.replace(sliced, overwrite=True), SLICES)
    assert _tree(out) == [("mine.txt", 8)] and not any(out.parent.glob(".merged.tmp-*"))
    with pytest.raises(ConfigError, match="contains the input"):
        merge_slices(dataclasses.replace(sliced, output=str(Path(sliced.input[0]).parent), overwrite=True), SLICES)


def test_merge_replaces_a_merged_dataset_with_overwrite(sliced):
    first = merge_slices(sliced, SLICES, keep_slices=True)
    with pytest.raises(OutputExistsError, match="already exists; pass overwrite=true"):
        merge_slices(sliced, SLICES, keep_slices=True)
    again = merge_slices(dataclasses.replace(sliced, overwrite=True), SLICES)
    assert again.splits == first.splits and read_manifest(sliced.output) == again
    assert not slices_root(sliced).exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_merge_refuses_a_slice_manifest_that_is_a_link_or_fifo(kind, sliced, tmp_path, capsys):
    manifest = slice_dir(sliced, 1) / "manifest.json"
    copy = tmp_path / "copy.json"
    shutil.copyfile(manifest, copy)
    manifest.unlink()
    manifest.symlink_to(copy) if kind == "symlink" else os.mkfifo(manifest)
    assert (
        _cli()(
            [
                "merge",
                "--num-slices",
                str(SLICES),
                f"output={sliced.output}",
                f"input={json.dumps(list(sliced.input))}",
                "tokenizer.vocab_size=400",
                "val_fraction=0.2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    what = "a symbolic link" if kind == "symlink" else "a FIFO"
    assert err.startswith(f"prep_slices merge: error: slice-00001: {manifest} is {what}, not a regular file"), err
    assert err.count("\n") == 1 and not Path(sliced.output).exists()


def test_prep_array_steps_by_hand(corpus, read_split, run_prep, tmp_path):
    """What launch/slurm/prep.sbatch runs (and tests/slurm checks on a cluster): the three CLI steps with one
    --config file, val_fraction=0.1, the vocabulary size as an override; then the merged dataset reads back the
    tokens of a single run with its tokenizer, and the slices are gone."""
    out = tmp_path / "merged"
    config = tmp_path / "prep.yaml"
    config.write_text(
        f"output: {out}\ninput: {corpus[0]}\nval_fraction: 0.1\nprogress: false\nshard_size_bytes: 16384\n"
    )
    cli, common = _cli(), ["--config", str(config), "tokenizer.vocab_size=320"]
    assert cli(["tokenizer", "--num-slices", str(SLICES), *common]) == 0
    for i in range(SLICES):
        assert cli(["slice", "--index", str(i), "--num-slices", str(SLICES), *common]) == 0
    assert cli(["merge", "--num-slices", str(SLICES), *common]) == 0
    manifest = read_manifest(out)
    assert manifest.config["num_slices"] == SLICES and manifest.tokenizer.trained
    assert not out.with_name("merged.slices").exists()
    run_prep(output=tmp_path / "single", tokenizer__model=out / "tokenizer.model", val_fraction=0.1)
    for split in ("train", "val"):
        tokens = [
            [t for s in read_split(root / split) for t in s["tokens"].tolist()] for root in (out, tmp_path / "single")
        ]
        assert len(tokens[0]) == manifest.splits[split].tokens > 0
        assert tokens[0] == tokens[1], split


def test_merge_cli_error_keeps_environment_values_out(sliced, capsys, monkeypatch):
    """An output taken from the environment may be a secret place: the one error line shows its interpolation."""
    monkeypatch.setenv("GCA_TEST_MERGE_OUT", sliced.output)
    assert (
        _cli()(
            [
                "merge",
                "--num-slices",
                "4",
                "output=${oc.env:GCA_TEST_MERGE_OUT}",
                f"input={json.dumps(list(sliced.input))}",
                "tokenizer.vocab_size=400",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("prep_slices merge: error: slices 3 of 4 in ${oc.env:GCA_TEST_MERGE_OUT}.slices are "), err
    assert sliced.output not in err


# -- tokenizer.type=hf: the shared tokenizer is a tokenizer.json (+ tokenizer_config.json) copied by the tokenizer step


@pytest.fixture(scope="module")
def hf_folders(corpus, tmp_path_factory) -> dict[str, Path]:
    """Byte-level BPE tokenizers of Llama-3's layout built offline: with a tokenizer_config.json, the same
    tokenizer.json with another config, without one, and another tokenizer.json."""
    root = tmp_path_factory.mktemp("hf_merge")
    tok = hf_test_tokenizer(corpus[1], 500)
    return {
        "config": save_hf_tokenizer(root / "config", tok, {"eos_token": "<|end_of_text|>"}),
        "other_config": save_hf_tokenizer(root / "other_config", tok, {"eos_token": "<|begin_of_text|>"}),
        "no_config": save_hf_tokenizer(root / "no_config", tok),
        "other": save_hf_tokenizer(root / "other", hf_test_tokenizer(corpus[1][:40], 400)),
    }


@pytest.fixture(scope="module")
def text_files(corpus, tmp_path_factory) -> Path:
    """Nine small .txt files (one document each): three per slice."""
    root = tmp_path_factory.mktemp("hf_texts")
    for i, text in enumerate(corpus[1][:9]):
        (root / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return root


def _hf(folder: Path) -> dict[str, object]:
    return {"tokenizer.type": "hf", "tokenizer.path": folder}


@pytest.mark.parametrize("folder", ["config", "no_config"])
def test_hf_merge_equals_a_single_run(folder, hf_folders, text_files, run_prep, read_split, join_documents, tmp_path):
    """A sliced tokenizer.type=hf run through the CLI: every slice encodes with the shared copy, and the merged dataset
    holds a single run's documents (ids and order), tokenizer files and manifest tokenizer fields."""
    source = hf_folders[folder]
    sliced = _make_slices(text_files, tmp_path / "merged", tokenizer=_hf(source))
    root = slices_root(sliced)
    shared = sorted(p.name for p in root.iterdir() if not p.name.startswith("slice-"))
    assert shared == [".prep-slices", "tokenizer.json"] + (["tokenizer_config.json"] if folder == "config" else [])
    for i in range(SLICES):
        assert read_manifest(slice_dir(sliced, i)).config["tokenizer"]["path"] == str(root)
    merged = merge_slices(sliced, SLICES)
    single = run_prep(output=tmp_path / "single", inputs=[str(text_files)], **_hf(source))

    out = Path(sliced.output)
    assert not root.exists() and read_manifest(out) == merged
    assert merged.tokenizer == single.tokenizer and merged.tokenizer.type == "hf" and not merged.tokenizer.trained
    assert merged.token_dtype == single.token_dtype and merged.inputs == single.inputs
    assert merged.config["tokenizer"] == single.config["tokenizer"] and merged.config["num_slices"] == SLICES
    files = sorted(p.name for p in out.iterdir() if p.name.startswith("tokenizer"))
    assert files == sorted(p.name for p in (tmp_path / "single").iterdir() if p.name.startswith("tokenizer"))
    for name in files:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    for split in ("train", "val"):
        assert merged.splits[split].documents == single.splits[split].documents > 0, split
        got, want = read_split(out / split), read_split(tmp_path / "single" / split)
        assert list(join_documents(got).values()) == list(join_documents(want).values()), split


def _reslice_with(cfg: PrepConfig, corpus_dir: Path, index: int, folder: Path) -> None:
    """Prepare slice ``index`` again with the tokenizer in ``folder`` instead of the shared one."""
    args = _settings(Path(cfg.output), corpus_dir, _hf(folder))
    prep_main(
        load_config(None, [*args, *slice_overrides(cfg, SLICES, index), f"tokenizer.path={folder}", "overwrite=true"])
    )


@pytest.mark.parametrize(
    ("folder", "used"),
    [
        ("other", r"hf, sha256 [0-9a-f]{16}, no tokenizer_config.json"),
        ("other_config", r"hf, sha256 [0-9a-f]{16}, tokenizer_config.json sha256 [0-9a-f]{16}"),
    ],
    ids=["another-tokenizer-json", "another-tokenizer-config"],
)
def test_hf_merge_refuses_a_slice_tokenized_otherwise(folder, used, hf_folders, text_files, tmp_path):
    sliced = _make_slices(text_files, tmp_path / "merged", tokenizer=_hf(hf_folders["config"]))
    _reslice_with(sliced, text_files, 1, hf_folders[folder])
    with pytest.raises(
        InputError,
        match=rf"^slice-00001 was tokenized with a different tokenizer \({used}; the shared one: hf, sha256 "
        r"[0-9a-f]{16}, tokenizer_config.json sha256 [0-9a-f]{16}\); rerun that slice$",
    ):
        merge_slices(sliced, SLICES)
    assert not Path(sliced.output).exists()


def test_merge_refuses_a_shared_tokenizer_of_another_type(hf_folders, text_files, tmp_path):
    sliced = _make_slices(text_files, tmp_path / "merged", tokenizer=_hf(hf_folders["no_config"]))
    with pytest.raises(
        InputError, match="merged.slices holds a shared tokenizer.json but the config says tokenizer.type=sentencepiece"
    ):
        merge_slices(_config(Path(sliced.output), text_files), SLICES)
    (slices_root(sliced) / "tokenizer.json").unlink()
    with pytest.raises(IncompleteDatasetError, match="merged.slices/tokenizer.json is missing: run the tokenizer step"):
        merge_slices(sliced, SLICES)


def test_hf_tokenizer_step_reruns_like_the_sentencepiece_one(hf_folders, text_files, tmp_path):
    """Leftover slices are refused without overwrite; with it, the HF files, slices and a killed tokenizer step's
    temporary file are deleted as the run's own, also when the rerun switches to a SentencePiece tokenizer; an HF
    file name held by a link is not prep's, and nothing is deleted then."""
    sliced = _make_slices(text_files, tmp_path / "merged", tokenizer=_hf(hf_folders["config"]))
    root = slices_root(sliced)
    (root / ".tokenizer_config.json.tmp-999999").write_text("half written")
    with pytest.raises(OutputExistsError, match="holds slices of an earlier run"):
        prepare_tokenizer(sliced)
    assert prepare_tokenizer(dataclasses.replace(sliced, overwrite=True)) == root / "tokenizer.json"
    assert sorted(p.name for p in root.iterdir()) == [".prep-slices", "tokenizer.json", "tokenizer_config.json"]
    trained = _config(Path(sliced.output), text_files, overwrite="true")
    assert prepare_tokenizer(trained) == root / "tokenizer.model"
    assert sorted(p.name for p in root.iterdir()) == [".prep-slices", "tokenizer.model"]
    (root / "tokenizer.model").unlink()
    (root / "tokenizer_config.json").symlink_to(hf_folders["config"] / "tokenizer_config.json")
    before = _tree(root)
    with pytest.raises(OutputExistsError, match=r"holds files a sliced run did not write \(tokenizer_config.json\)"):
        prepare_tokenizer(dataclasses.replace(sliced, overwrite=True))
    assert _tree(root) == before


def test_a_sliced_hf_run_needs_no_trained_tokenizer(hf_folders, tmp_path):
    """A tokenizer.json is given, never trained: num_slices with type=hf is a valid config, and each slice is pointed at
    the tokenizer step's copy (without the SentencePiece keys, which type=hf refuses)."""
    args = [f"output={tmp_path / 'o'}", "input=x", "tokenizer.type=hf", f"tokenizer.path={hf_folders['config']}"]
    assert load_config(None, [*args, "num_slices=2", "slice_index=1"]).tokenizer.path == str(hf_folders["config"])
    assert slice_overrides(load_config(None, args), 2, 1) == [
        f"output={tmp_path / 'o.slices' / 'slice-00001'}",
        "num_slices=2",
        "slice_index=1",
        f"tokenizer.path={tmp_path / 'o.slices'}",
    ]

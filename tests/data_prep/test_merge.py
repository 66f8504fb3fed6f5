"""Sliced prep + merge (``data_prep.merge``): the merged dataset equals a single run with the same tokenizer."""

import dataclasses
import json
import os
import runpy
import shutil
from pathlib import Path

import pytest

from data_prep.config import PrepConfig, load_config
from data_prep.errors import ConfigError, InputError, OutputExistsError
from data_prep.format import IncompleteDatasetError, read_manifest
from data_prep.merge import merge_slices, prepare_tokenizer, slice_dir, slices_root

REPO = Path(__file__).resolve().parents[2]
SLICES = 3


def _config(out: Path, corpus_dir: Path, **extra: object) -> PrepConfig:
    """The sliced run's config as the user writes it (settings as in `run_prep`; no per-slice overrides)."""
    settings = {"tokenizer.vocab_size": 400, "val_fraction": 0.2, "progress": False, "shard_size_bytes": 16384}
    settings.update(extra)
    return load_config(None, [f"output={out}", f"input={json.dumps([str(corpus_dir)])}"]
                       + [f"{k}={v}" for k, v in settings.items()])


@pytest.fixture
def sliced(corpus, tmp_path) -> PrepConfig:
    """The tokenizer step and all slices of a 3-slice run, through the CLI the SLURM array runs."""
    cli = runpy.run_path(str(REPO / "launch/slurm/prep_slices.py"))["cli"]
    cfg = _config(tmp_path / "merged", corpus[0])
    args = [f"output={cfg.output}", f"input={json.dumps([str(corpus[0])])}", "tokenizer.vocab_size=400",
            "val_fraction=0.2", "progress=false", "shard_size_bytes=16384"]
    assert cli(["tokenizer", *args]) == 0
    for i in range(SLICES):
        assert cli(["slice", "--index", str(i), "--num-slices", str(SLICES), *args]) == 0
    return cfg


def test_merge_equals_a_single_run(sliced, run_prep, read_split, join_documents, tmp_path):
    out = Path(sliced.output)
    shutil.copyfile(slices_root(sliced) / "tokenizer.model", tmp_path / "tok.model")  # the merge deletes the slices
    slice_shards = sum(len(json.loads((slice_dir(sliced, i) / "train/index.json").read_text())["shards"])
                       for i in range(SLICES))
    merged = merge_slices(sliced, SLICES)
    assert not slices_root(sliced).exists()
    single = run_prep(output=tmp_path / "single", tokenizer__model=tmp_path / "tok.model")

    assert read_manifest(out) == merged
    assert merged.tokenizer.trained and merged.tokenizer.sha256 == single.tokenizer.sha256
    assert merged.config["num_slices"] == SLICES and merged.config["tokenizer"]["vocab_size"] == 400
    assert merged.inputs == single.inputs and merged.skipped == single.skipped
    assert len(json.loads((out / "train/index.json").read_text())["shards"]) == slice_shards
    for split in ("train", "val"):
        a, b = merged.splits[split], single.splits[split]
        assert (a.documents, a.pieces, a.tokens) == (b.documents, b.pieces, b.tokens), split
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


def test_merge_cli_reports_one_line(sliced, capsys):
    cli = runpy.run_path(str(REPO / "launch/slurm/prep_slices.py"))["cli"]
    assert cli(["merge", "--num-slices", "4", f"output={sliced.output}", f"input={json.dumps(list(sliced.input))}",
                "tokenizer.vocab_size=400"]) == 2
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
    assert sorted(p.name for p in slices_root(sliced).iterdir()) == ["tokenizer.model"]


def test_slicing_needs_a_shared_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="num_slices=3 needs a shared tokenizer: set 'tokenizer.model'"):
        load_config(None, [f"output={tmp_path / 'o'}", "input=x", "tokenizer.vocab_size=400", "num_slices=3"])
    model = tmp_path / "m.model"
    model.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"slice_index=2: must be in \[0, num_slices=2\)"):
        load_config(None, [f"output={tmp_path / 'o'}", "input=x", f"tokenizer.model={model}", "num_slices=2",
                           "slice_index=2"])


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
    cli = runpy.run_path(str(REPO / "launch/slurm/prep_slices.py"))["cli"]
    assert cli(["merge", "--num-slices", str(SLICES), f"output={sliced.output}",
                f"input={json.dumps(list(sliced.input))}", "tokenizer.vocab_size=400", "val_fraction=0.2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prep_slices merge: error: ") and expected in err and err.count("\n") == 1, err
    assert not Path(sliced.output).exists() and not any(Path(sliced.output).parent.glob(".merged.tmp-*"))
    assert sorted((p.name, p.lstat().st_size) for p in split.iterdir()) == before
    assert victim.read_bytes() == content and not Path("/tmp/gca-merge-abs.mds.zstd").exists()

"""Data prep against hostile or unlucky settings: what overwrite may delete, empty splits, unwritable outputs and
a full disk, malformed configs, and values from the environment that must not reach output or files.

Every refusal is checked against the file system itself (a snapshot of every path and its bytes before and after),
every split prep writes is opened with streaming's own reader, and the secret checks read every byte prep printed
or wrote.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep import shard
from data_prep.cli import main as cli  # prep's command line (launch/prep.py), in-process so faults can be injected
from data_prep.config import load_config
from data_prep.errors import ConfigError, InputError, OutputExistsError, OutputWriteError
from data_prep.format import SPLITS, read_manifest
from data_prep.split import is_val
from data_prep.streaming_compat import ensure_streaming_importable

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]
WORDS = "river mill farm train valley dawn theorem proof lemma integral matrix vector return class".split()


def _corpus(root: Path, n_docs: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n_docs):
        (root / f"doc{i:02d}.txt").write_text(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40 + i)))
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece model trained once, so that most runs below skip tokenizer training."""
    root = tmp_path_factory.mktemp("tok")
    _prep(root / "ds", _corpus(root / "corpus", 6), **{"tokenizer.vocab_size": 300})
    model = root / "tokenizer.model"
    model.write_bytes((root / "ds" / "tokenizer.model").read_bytes())
    return model


def _args(output: Path, corpus: Path, **extra: object) -> list[str]:
    settings: dict[str, object] = {"progress": "false", **extra}
    return [f"output={output}", f"input={corpus}", *(f"{k}={v}" for k, v in settings.items())]


def _prep(output: Path, corpus: Path, **extra: object):
    return shard.main(load_config(None, _args(output, corpus, **extra)))


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links as their target text, never followed) -> content hash."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def _read_split(split_dir: Path, cache: Path | None) -> list[dict]:
    """Every sample of a split through streaming's own reader; ``cache=None`` reads it in place."""
    ensure_streaming_importable()
    from streaming import StreamingDataset

    remote, local = (None, str(split_dir)) if cache is None else (str(split_dir), str(cache))
    ds = StreamingDataset(remote=remote, local=local, shuffle=False, batch_size=1, validate_hash="xxh64")
    return [ds[i] for i in range(len(ds))]


@pytest.fixture
def dataset(tmp_path: Path, tokenizer: Path) -> Path:
    """A complete dataset prep wrote, at ``tmp_path/out``, from a corpus outside it."""
    _prep(tmp_path / "out", _corpus(tmp_path / "corpus", 6), val_fraction=0.5, **{"tokenizer.model": tokenizer})
    return tmp_path / "out"


# ---- overwrite deletes only what prep wrote -----------------------------------------------------------------


def _foreign_dir(tmp_path: Path, dataset: Path) -> tuple[Path, Path]:
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "precious.txt").write_text("somebody's work")
    return out, tmp_path / "corpus"


def _corpus_inside_output(tmp_path: Path, dataset: Path) -> tuple[Path, Path]:
    corpus = _corpus(dataset / "my_corpus", 3)
    return dataset, corpus


def _dataset_with_user_file(tmp_path: Path, dataset: Path) -> tuple[Path, Path]:
    (dataset / "notes.md").write_text("my notes about this dataset")
    return dataset, tmp_path / "corpus"


def _tampered_manifest(tmp_path: Path, dataset: Path) -> tuple[Path, Path]:
    manifest = dataset / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"val_fraction": 0.5', '"val_fraction": 0.25'))
    return dataset, tmp_path / "corpus"


def _link_in_split(tmp_path: Path, dataset: Path) -> tuple[Path, Path]:
    victim = tmp_path / "victim.txt"
    victim.write_text("must survive")
    (dataset / "train" / "shard.00000.mds.tmp").symlink_to(victim)
    return dataset, tmp_path / "corpus"


def _output_is_link(tmp_path: Path, dataset: Path) -> tuple[Path, Path]:
    link = tmp_path / "link"
    link.symlink_to(dataset)
    return link, tmp_path / "corpus"


@pytest.mark.parametrize(
    ("arrange", "error", "match"),
    [
        (_foreign_dir, OutputExistsError, "is not a complete dataset written by prep"),
        (_corpus_inside_output, ConfigError, "contains the input"),
        (_dataset_with_user_file, OutputExistsError, r"holds files prep did not write \(notes\.md\)"),
        (_tampered_manifest, OutputExistsError, "is not a complete dataset written by prep"),
        (_link_in_split, OutputExistsError, r"did not write \(train/shard\.00000\.mds\.tmp\)"),
        (_output_is_link, ConfigError, "is a symbolic link"),
    ],
)
def test_overwrite_refuses_what_prep_did_not_write_before_any_work(
    arrange, error, match, dataset, tmp_path, tokenizer, monkeypatch
):
    output, corpus = arrange(tmp_path, dataset)
    before = _snapshot(tmp_path)
    monkeypatch.setattr(shard, "_prepare", lambda *a: pytest.fail("work started before the output was checked"))
    with pytest.raises(error, match=match) as caught:
        _prep(output, corpus, overwrite="true", **{"tokenizer.model": tokenizer})
    assert str(output) in str(caught.value) and "\n" not in str(caught.value)
    assert _snapshot(tmp_path) == before, "nothing was created, changed or deleted"


def test_output_holding_the_tokenizer_or_the_working_directory_is_refused(dataset, tmp_path, monkeypatch):
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match="contains tokenizer.model="):
        _prep(dataset, tmp_path / "corpus", overwrite="true", **{"tokenizer.model": dataset / "tokenizer.model"})
    work = tmp_path / "project" / "src"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    with pytest.raises(ConfigError, match="is or contains the current directory"):
        _prep(tmp_path / "project", tmp_path / "corpus", overwrite="true", **{"tokenizer.vocab_size": 300})
    with pytest.raises(ConfigError, match="is or contains the repository"):
        _prep(REPO, tmp_path / "corpus", overwrite="true", **{"tokenizer.vocab_size": 300})
    assert _snapshot(tmp_path) == {**before, "project": "dir", "project/src": "dir"}


def test_overwrite_replaces_its_own_dataset_and_deletes_only_its_files(dataset, tmp_path, tokenizer):
    old = read_manifest(dataset)
    # reading a split in place (as older trainers did) decompresses shards beside their zips: still prep's files
    assert len(_read_split(dataset / "train", None)) == old.splits["train"].pieces
    assert list((dataset / "train").glob("shard.*.mds"))
    neighbour = tmp_path / "neighbour.txt"
    neighbour.write_text("next to the output, not in it")
    new = _prep(dataset, tmp_path / "corpus", overwrite="true", val_fraction=0.2, **{"tokenizer.model": tokenizer})
    assert read_manifest(dataset) == new != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "neighbour.txt", "out"], "no work dirs left"
    assert neighbour.read_text() == "next to the output, not in it"
    assert not list(dataset.rglob("shard.*.mds")), "the old decompressed shards went with the old dataset"
    assert sorted(p.name for p in dataset.iterdir()) == sorted(
        ["_COMPLETE", "manifest.json", "tokenizer.model", *(s for s in SPLITS if new.has_split(s))]
    )


# ---- empty splits ---------------------------------------------------------------------------------------------


def test_one_document_corpus_with_default_val_fraction_writes_only_readable_splits(tmp_path, tokenizer, caplog):
    corpus = _corpus(tmp_path / "corpus", 1)  # two or more get a val document (tests/data_prep/test_val_split.py)
    # val_fraction 0.01 of whole documents (val_unit=auto would hold out the document's tail instead)
    manifest = _prep(tmp_path / "out", corpus, val_unit="documents", **{"tokenizer.model": tokenizer})
    assert (manifest.splits["val"].documents, manifest.splits["val"].tokens) == (0, 0)
    assert not manifest.has_split("val") and not (tmp_path / "out" / "val").exists()
    assert read_manifest(tmp_path / "out").splits["val"].tokens == 0, "readers learn it from manifest.json"
    assert "val split is empty" in caplog.text and "no val/ directory" in caplog.text
    for split in SPLITS:  # streaming's own reader opens every split directory prep wrote
        if (tmp_path / "out" / split).exists():
            samples = _read_split(tmp_path / "out" / split, tmp_path / f"cache-{split}")
            assert sum(len(s["tokens"]) for s in samples) == manifest.splits[split].tokens > 0


def test_no_train_document_is_an_error_and_writes_nothing(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = next(t for t in (f"document {i} " * 20 for i in range(100)) if is_val(t, 0.9, 0))
    (corpus / "only.txt").write_text(text)
    with pytest.raises(InputError, match="no document reached the train split"):
        _prep(tmp_path / "out", corpus, val_fraction=0.9, **{"tokenizer.model": tokenizer})
    with pytest.raises(InputError, match="no text to train the tokenizer on"):  # not sentencepiece's own words
        _prep(tmp_path / "out", corpus, val_fraction=0.9, **{"tokenizer.vocab_size": 300})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


# ---- inputs that are not regular files --------------------------------------------------------------------------


def _corpus_with_special_files(root: Path) -> Path:
    """Two documents beside a FIFO with a data name, a FIFO without one and a link to a character device."""
    corpus = _corpus(root, 2)
    os.mkfifo(corpus / "pipe.jsonl")
    os.mkfifo(corpus / "pipe")
    (corpus / "null.txt").symlink_to("/dev/null")
    return corpus


@pytest.mark.parametrize("form", ["folder", "glob"])
def test_fifos_and_devices_in_a_folder_or_glob_are_counted_as_skipped(form, tmp_path, tokenizer, caplog):
    """Never opened (a FIFO read would block, a device never end), and never silently dropped either: each is a
    ``not_a_regular_file`` skip in the manifest, warned about by name; ``strict=true`` refuses the first."""
    corpus = _corpus_with_special_files(tmp_path / "corpus")
    source = corpus if form == "folder" else corpus / "*"
    manifest = _prep(tmp_path / "out", source, val_fraction=0, **{"tokenizer.model": tokenizer})
    assert manifest.skipped == {"not_a_regular_file": 3}
    assert manifest.splits["train"].documents == 2
    for name, kind in (("pipe.jsonl", "a FIFO"), ("pipe", "a FIFO"), ("null.txt", "a character device")):
        assert f"{corpus / name}: not a regular file: {kind}" in caplog.text
    with pytest.raises(InputError, match=r"null\.txt: not a regular file: a character device.*strict=true"):
        _prep(tmp_path / "strict", source, strict="true", **{"tokenizer.model": tokenizer})
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize(("name", "kind"), [("pipe.jsonl", "a FIFO"), ("null.txt", "a character device")])
def test_a_fifo_or_device_named_as_input_is_one_line_saying_what_it_is(name, kind, tmp_path, tokenizer, capsys):
    corpus = _corpus_with_special_files(tmp_path / "corpus")
    args = _args(tmp_path / "out", corpus / name, **{"tokenizer.model": tokenizer})
    assert cli(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"prep: error: input '{corpus / name}' is {kind}, not a regular file; prep reads regular files only"
        " (write the data to a file and name that)"
    ]
    assert not (tmp_path / "out").exists()


# ---- unwritable outputs and a full disk -------------------------------------------------------------------------


def test_output_under_a_file_fails_before_work_naming_the_path(tmp_path, tokenizer, monkeypatch):
    _corpus(tmp_path / "corpus", 3)
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setattr(shard, "_prepare", lambda *a: pytest.fail("work started"))
    with pytest.raises(OutputWriteError, match=r"a_file.*needs a writable parent directory"):
        _prep(tmp_path / "a_file" / "out", tmp_path / "corpus", **{"tokenizer.model": tokenizer})


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no one may write into: mode 0555, and for root (who writes through permissions) also the
    immutable attribute (``chattr +i``), removed again afterwards."""
    path = tmp_path / "ro"
    path.mkdir(mode=0o555)
    immutable = os.geteuid() == 0
    if immutable:
        subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
    try:
        with pytest.raises(OSError):
            (path / "probe").touch()  # the premise: this directory really refuses writes
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True, capture_output=True)


def test_read_only_parent_fails_before_work_naming_the_path(tmp_path, tokenizer, read_only_dir):
    _corpus(tmp_path / "corpus", 3)
    with pytest.raises(OutputWriteError, match=r"ro.*needs a writable parent directory"):
        _prep(read_only_dir / "out", tmp_path / "corpus", **{"tokenizer.model": tokenizer})
    assert list(read_only_dir.iterdir()) == []


def test_disk_full_during_overwrite_keeps_the_old_dataset(dataset, tmp_path, tokenizer, monkeypatch, capsys):
    before = _snapshot(dataset)
    real_write, calls = shard._SplitWriter.write, [0]

    def write(self, doc_id, tokens):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.out / "shard.00001.mds"))
        real_write(self, doc_id, tokens)

    monkeypatch.setattr(shard._SplitWriter, "write", write)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # cli installs a redacting hook; keep it to this test
    code = cli(_args(dataset, tmp_path / "corpus", overwrite="true", **{"tokenizer.model": tokenizer}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("prep: error: cannot write ") and "disk is full" in err[0] and str(dataset) in err[0]
    assert _snapshot(dataset) == before, "the old dataset is untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"], "the work directory was removed"


# ---- malformed configs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["- output: data/x\n- input: corpus\n", "42\n", "just some text\n"])
def test_yaml_whose_top_level_is_not_a_mapping_is_one_line_naming_the_file(text, tmp_path, capsys):
    path = tmp_path / "prep.yaml"
    path.write_text(text)
    assert cli(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config file {path}: the top level must be a mapping of prep keys" in err[0], err


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("val_fraction", "nan"),
        ("val_fraction", "-0.1"),
        ("val_fraction", "1.5"),
        ("val_fraction", "inf"),
        ("shard_size_bytes", "0"),
        ("shard_size_bytes", "-5"),
        ("num_proc", "0"),
        ("min_tokens", "-1"),
        ("max_piece_tokens", "0"),
        ("split_seed", "-1"),
        ("tokenizer.vocab_size", "10"),
        ("tokenizer.sample_bytes", "0"),
        ("tokenizer.character_coverage", "nan"),
        ("tokenizer.character_coverage", "0"),
    ],
)
def test_bad_numbers_are_refused_naming_key_and_value(key, value, tmp_path):
    extra = {"tokenizer.vocab_size": 300, key: value}
    with pytest.raises(ConfigError) as caught:
        load_config(None, _args(tmp_path / "out", tmp_path, **extra))
    assert f"{key}={value}" in str(caught.value).replace("'", ""), str(caught.value)
    assert not (tmp_path / "out").exists()


# ---- values from the environment --------------------------------------------------------------------------------


def test_environment_values_never_reach_output_files_or_errors(tmp_path, tokenizer, monkeypatch, capsys):
    field, out_name, bad = "fld9Q3ZsentinelX", "out7KsentinelW", "/nonexistent/tok8PsentinelV.model"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({field: f"record {i} " + " ".join(WORDS)}) + "\n" for i in range(8))
    )
    env = {
        **os.environ,
        "GCA_TEST_FIELD": field,
        "GCA_TEST_OUT": str(tmp_path / out_name),
        "GCA_TEST_TOK": bad,
        "OMP_NUM_THREADS": "1",
    }
    common = [
        "output=${oc.env:GCA_TEST_OUT}",
        f"input={corpus}",
        "text_field=${oc.env:GCA_TEST_FIELD}",
        "progress=false",
        "val_fraction=0.3",
    ]
    ok = subprocess.run(
        [sys.executable, "launch/prep.py", *common, f"tokenizer.model={tokenizer}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    manifest = read_manifest(tmp_path / out_name)
    assert manifest.splits["train"].documents + manifest.splits["val"].documents == 8, "the run itself works"
    assert manifest.config["text_field"] == "${oc.env:GCA_TEST_FIELD}"
    assert manifest.config["output"] == "${oc.env:GCA_TEST_OUT}"
    for name in ("GCA_TEST_FIELD", "GCA_TEST_OUT", "GCA_TEST_TOK"):  # the failing run in-process (saves a start-up)
        monkeypatch.setenv(name, env[name])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # cli installs a redacting hook; keep it to this test
    assert cli([*common, "tokenizer.model=${oc.env:GCA_TEST_TOK}"]) == 2
    failed = capsys.readouterr()
    assert failed.err.strip().splitlines() == [
        "prep: error: bad value tokenizer.model='${oc.env:GCA_TEST_TOK}': file does not exist"
    ]
    written = b"".join(p.read_bytes() for p in (tmp_path / out_name).rglob("*") if p.is_file())
    names = " ".join(str(p.relative_to(tmp_path / out_name)) for p in (tmp_path / out_name).rglob("*"))
    for sentinel in ("sentinelX", "sentinelW", "sentinelV"):
        for where, text in (
            ("stdout", ok.stdout + failed.out),
            ("stderr", ok.stderr + failed.err),
            ("files", written.decode("latin-1")),
            ("file names", names),
        ):
            assert sentinel not in text, f"{sentinel} leaked into {where}"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_replaced_dataset_left_by_a_killed_run_is_kept_while_it_is_the_only_copy(dataset, tmp_path, tokenizer):
    """A run killed between moving the old dataset aside and moving the new one in leaves only ``.out.old-<pid>``."""
    aside = tmp_path / f".out.old-{_dead_pid()}"
    dataset.rename(aside)
    kept = _snapshot(aside)
    _prep(dataset, tmp_path / "corpus", **{"tokenizer.model": tokenizer})
    assert _snapshot(aside) == kept, "the only copy of the previous dataset is not deleted"
    _prep(dataset, tmp_path / "corpus", overwrite="true", val_fraction=0.3, **{"tokenizer.model": tokenizer})
    assert not aside.exists(), "once a complete output exists, the aside copy is a leftover and goes"

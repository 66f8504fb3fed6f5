"""``hf:`` inputs through the real ``datasets`` library (the pinned version), offline, on files made here: packaged
builders over local parquet / json / jsonl.zst / arrow files, a local data directory with ``hf.data_dir``, a
``save_to_disk`` folder; streaming and not; and a sliced prep + merge over ``hf:`` slices equal to one run."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import zstandard

from data_prep.cli import slices_main
from data_prep.config import load_config
from data_prep.errors import ConfigError, InputError
from data_prep.merge import merge_slices, slices_root
from data_prep.shard import main as prep_main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, and the HF cache (written by non-streaming loads) inside the test directory."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    return corpus[1][:36]


def _parts(texts: list[str], n: int) -> list[list[str]]:
    return [texts[i * len(texts) // n : (i + 1) * len(texts) // n] for i in range(n)]


def _write_parquet(directory: Path, texts: list[str], n: int = 3) -> None:
    directory.mkdir(parents=True)
    for i, part in enumerate(_parts(texts, n)):
        pq.write_table(pa.table({"text": part, "n": list(range(len(part)))}), directory / f"part-{i}.parquet")


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def _prep(out: Path, inputs: list[str], **overrides: object) -> tuple[list[str], object]:
    """Run prep; the decoded documents of train then val (in dataset order) and the manifest."""
    import streaming

    settings = {"tokenizer.vocab_size": 400, "val_fraction": 0.2, "progress": False, **overrides}
    cfg = load_config(
        None, [f"output={out}", f"input={json.dumps(inputs)}"] + [f"{k}={v}" for k, v in settings.items()]
    )
    manifest = prep_main(cfg)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    docs: list[str] = []
    for split in ("train", "val"):
        if manifest.has_split(split):
            ds = streaming.StreamingDataset(local=str(out / split), shuffle=False, batch_size=1)
            by_doc: dict[int, list[int]] = {}
            for i in range(len(ds)):
                by_doc.setdefault(int(ds[i]["doc_id"]), []).extend(ds[i]["tokens"].tolist())
            docs += [sp.decode(ids) for ids in by_doc.values()]
    return docs, manifest


def _local_forms(root: Path, texts: list[str]) -> dict[str, tuple[list[str], dict[str, object]]]:
    """input and hf.* overrides of each local form, all holding ``texts`` in this order."""
    import datasets

    _write_parquet(root / "parquet", texts)
    (root / "json").mkdir()
    for i, part in enumerate(_parts(texts, 2)):
        (root / "json" / f"part-{i}.jsonl").write_bytes(_jsonl(part))
        (root / "json" / f"part-{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(part)))
    saved = datasets.Dataset.from_dict({"text": texts})
    saved.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": saved, "test": saved.select([0])}).save_to_disk(str(root / "saved_dict"))
    _write_parquet(root / "repo" / "en", texts)
    _write_parquet(root / "repo" / "de", texts[:3])
    files = json.dumps
    return {
        "parquet": (["hf:parquet"], {"hf.data_files": files([str(root / "parquet/*.parquet")])}),
        "json": (["hf:json"], {"hf.data_files": files([str(root / "json/*.jsonl")])}),
        "jsonl.zst": (["hf:json"], {"hf.data_files": files([str(root / "json/*.jsonl.zst")])}),
        "arrow": (["hf:arrow"], {"hf.data_files": files([str(root / "saved/data-*.arrow")])}),
        "save_to_disk": ([f"hf:{root / 'saved'}"], {}),
        "save_to_disk dict": ([f"hf:{root / 'saved_dict'}"], {}),
        "data_dir": ([f"hf:{root / 'repo'}"], {"hf.data_dir": "en"}),
    }


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "not-streaming"])
def test_every_local_form_gives_exactly_its_documents(texts, tmp_path, streaming):
    """Each form prepares exactly its documents (train + val, none lost, none extra, whitespace kept), all forms
    agree with each other, and the manifest names the data files."""
    forms = _local_forms(tmp_path / "in", texts)
    results = {}
    for name, (inputs, overrides) in forms.items():
        out = tmp_path / name.replace(" ", "_")
        docs, manifest = _prep(out, inputs, **overrides, **{"hf.streaming": streaming})
        assert sorted(docs) == sorted(texts), name
        results[name] = docs
        if "hf.data_files" in overrides:
            assert json.loads(str(overrides["hf.data_files"]))[0] in manifest.inputs[0].path
    assert len({tuple(d) for d in results.values()}) == 1, "every form reads the documents in the same order"


def test_sliced_prep_and_merge_over_hf_slices_equal_one_run(texts, tmp_path):
    """The SLURM array's three steps over an ``hf:parquet`` input of 3 files and 3 slices: each slice reads one
    file (``IterableDataset.shard``), and the merged dataset holds the documents of a single run, in its order."""
    _write_parquet(tmp_path / "in", texts)
    args = [
        f"output={tmp_path / 'merged'}",
        "input=[hf:parquet]",
        f"hf.data_files={json.dumps([str(tmp_path / 'in/*.parquet')])}",
        "tokenizer.vocab_size=400",
        "val_fraction=0.2",
        "progress=false",
    ]
    assert slices_main(["tokenizer", *args]) == 0
    for i in range(3):
        assert slices_main(["slice", "--index", str(i), "--num-slices", "3", *args]) == 0
    cfg = load_config(None, args)
    tokenizer = tmp_path / "tok.model"
    shutil.copyfile(slices_root(cfg) / "tokenizer.model", tokenizer)
    merged = merge_slices(cfg, 3)
    assert [i.path.endswith(f"(slice {k} of 3)") for k, i in enumerate(merged.inputs)] == [True] * 3
    single_docs, single = _prep(
        tmp_path / "single",
        ["hf:parquet"],
        **{"hf.data_files": json.dumps([str(tmp_path / "in/*.parquet")]), "tokenizer.vocab_size": "null"},
        **{"tokenizer.model": tokenizer},
    )
    import streaming

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    for split in ("train", "val"):
        got = streaming.StreamingDataset(local=str(tmp_path / "merged" / split), shuffle=False, batch_size=1)
        want = streaming.StreamingDataset(local=str(tmp_path / "single" / split), shuffle=False, batch_size=1)
        assert [got[i]["tokens"].tolist() for i in range(len(got))] == [
            want[i]["tokens"].tolist() for i in range(len(want))
        ], split
        assert merged.splits[split].tokens == single.splits[split].tokens
    assert sorted(single_docs) == sorted(texts) and sp.get_piece_size() == 400


def test_hf_inputs_that_cannot_load_are_one_line(texts, tmp_path):
    """Offline hub name, a loading script (refused by datasets 5), a missing split, more slices than files: each
    a one-line InputError/ConfigError naming the input, before any output exists."""
    _write_parquet(tmp_path / "in", texts)
    script = tmp_path / "scripted"
    script.mkdir()
    (script / "scripted.py").write_text("raise SystemExit('never run')\n")
    cases = [
        (["hf:deepmind/pg19"], {}, r"^hf:deepmind/pg19:train: cannot load dataset \(ConnectionError: "),
        ([f"hf:{script}"], {}, r"cannot load dataset \(RuntimeError: Dataset scripts are no longer supported"),
        (
            ["hf:parquet"],
            {"hf.data_files": json.dumps([str(tmp_path / "in/*.parquet")]), "hf.split": "validation"},
            r"cannot load dataset \(ValueError: .*validation",
        ),
    ]
    for inputs, overrides, match in cases:
        with pytest.raises(InputError, match=match) as err:
            _prep(tmp_path / "out", inputs, **overrides)
        assert "\n" not in str(err.value)
        assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match=r"num_slices=4 is more than the dataset's 3 files; use at most 3 slices"):
        _prep(
            tmp_path / "out",
            ["hf:parquet"],
            **{"hf.data_files": json.dumps([str(tmp_path / "in/*.parquet")]), "num_slices": 4, "slice_index": 0},
            **{"tokenizer.vocab_size": "null", "tokenizer.model": _any_model(tmp_path, texts)},
        )
    with pytest.raises(ConfigError, match=r"one hf: input alone; hf:parquet.* cannot be sliced beside other inputs"):
        _prep(
            tmp_path / "out",
            ["hf:parquet", str(tmp_path / "in")],
            **{"hf.data_files": json.dumps([str(tmp_path / "in/*.parquet")]), "num_slices": 2, "slice_index": 0},
            **{"tokenizer.vocab_size": "null", "tokenizer.model": _any_model(tmp_path, texts)},
        )


def _any_model(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "any.model"
    if not path.exists():
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(tmp_path / "any"),
            vocab_size=60,
            minloglevel=2,
            hard_vocab_limit=False,
        )
    return path


@pytest.mark.parametrize("name", ["pg19", "proof_pile_arxiv"])
def test_real_corpus_configs_load_with_the_pinned_datasets(name, texts, tmp_path):
    """The shipped config's builder and data_files, with the ``hf://datasets/<repo>@<revision>/`` prefix pointed at
    a local directory of the same layout (no network): the pinned ``datasets`` reads its documents in order."""
    from data_prep.sources import SkipCounter, resolve_sources

    cfg = load_config(REPO / "configs/data" / f"{name}.yaml", [f"output={tmp_path / 'out'}"])
    [pattern] = cfg.hf.data_files
    assert pattern.startswith("hf://datasets/") and cfg.input[0] in ("hf:parquet", "hf:json")
    relative = pattern.split("/", 4)[4]  # hf://datasets/<owner>/<repo>@<revision>/<path in the repository>
    directory = tmp_path / "mirror" / Path(relative).parent
    directory.mkdir(parents=True)
    for i, part in enumerate(_parts(texts, 2)):
        if cfg.input[0] == "hf:parquet":
            pq.write_table(pa.table({"text": part}), directory / f"train-{i:05d}.parquet")
        else:
            (directory / f"train-{i:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(part)))
    local = dataclasses.replace(cfg, hf=dataclasses.replace(cfg.hf, data_files=[str(directory / Path(relative).name)]))
    [source] = resolve_sources(local)
    assert [d.text for d in source.documents(SkipCounter(strict=True))] == texts

"""launch/eval.py and launch/generate.py end to end on a tiny export (JSON shape, plots, error messages)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from data_prep.schema import ConfigError
from pipeline.evaluation.config import TASKS, load_eval_config

ROOT = Path(__file__).resolve().parents[2]


def _launch(name):
    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_eval_writes_json_and_plot(tiny_export, tmp_path, task):
    lengths = "lengths=[400,800]" if task == "passkey" else "lengths=[256,512]"
    extra = ["depths=[0,1]", "variant=multikey", "samples=1", "needles=2"] if task == "passkey" else ["score_len=64"]
    rc = _launch("eval")(
        [
            "--checkpoint",
            str(tiny_export),
            "--task",
            task,
            "--out",
            str(tmp_path),
            lengths,
            "segment=100",
            "progress=false",
            *extra,
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / f"{task}.json").read_text())
    assert result["task"] == task and result["checkpoint"] == str(tiny_export) and result["train_seq_len"] == 128
    rows = result["results"]
    if task == "ppl":  # the context rows, then the whole-document row, over the same 4 filler documents
        assert [(r["kind"], r.get("length")) for r in rows] == [("context", 256), ("context", 512), ("document", None)]
        assert [(r["documents"], r["tokens"]) for r in rows] == [(4, 4 * 64), (4, 4 * 64), (4, 4 * 511)]
        assert all(r["ppl"] == pytest.approx(math.exp(r["nll"])) for r in rows)
    else:
        assert [r["length"] for r in rows] == [400, 400, 800, 800]
        assert all({"depth", "accuracy", "exact_match", "n"} <= set(r) for r in rows)
    assert (tmp_path / f"{task}.png").stat().st_size > 1000


def test_ppl_without_the_document_row(tiny_export, tmp_path, monkeypatch):
    """``document_ppl=false`` writes the context rows only and never streams a whole document."""
    from pipeline.evaluation import run

    def whole_documents(*args, **kwargs):
        raise AssertionError("document_ppl ran although document_ppl=false")

    monkeypatch.setattr(run, "document_ppl", whole_documents)
    args = ["lengths=[256]", "score_len=64", "segment=100", "progress=false", "document_ppl=false"]
    assert _launch("eval")(["--checkpoint", str(tiny_export), "--task", "ppl", "--out", str(tmp_path), *args]) == 0
    rows = json.loads((tmp_path / "ppl.json").read_text())["results"]
    assert [(r["kind"], r["length"], r["documents"]) for r in rows] == [("context", 256, 4)]


def test_ppl_default_score_len_fits_lengths_starting_at_the_training_length(tiny_export, tmp_path, caplog):
    """The issue's command shape: lengths starting at the training length (128 here) and no ``score_len``. It runs,
    scores half the shortest length, says so, records it, and its rows are those of that ``score_len`` given."""
    caplog.set_level("INFO")
    common = ["--task", "ppl", "lengths=[128,256]", "segment=100", "progress=false", "document_ppl=false"]
    assert _launch("eval")(["--checkpoint", str(tiny_export), "--out", str(tmp_path / "default"), *common]) == 0
    assert "score_len not set: scoring the final 64 tokens" in caplog.text
    default = json.loads((tmp_path / "default" / "ppl.json").read_text())
    assert default["config"]["score_len"] == 64
    given = ["--checkpoint", str(tiny_export), "--out", str(tmp_path / "given"), *common, "score_len=64"]
    assert _launch("eval")(given) == 0
    reference = json.loads((tmp_path / "given" / "ppl.json").read_text())
    timing = ("seconds", "tokens_per_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in default["results"]] == [
        {k: v for k, v in r.items() if k not in timing} for r in reference["results"]
    ]


@pytest.mark.parametrize(("lengths", "score_len"), [([2], 1), ([3, 9], 1), ([1024, 4096, 16384], 512), ([2048], 1024)])
def test_ppl_default_score_len_is_half_the_shortest_length_at_most_1024(lengths, score_len):
    assert load_eval_config(None, [f"lengths={lengths}"], task="ppl")[0].score_len == score_len


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["lengths=[8,64]", "score_len=4"], "below one chunk"),
        (["lenghts=[64]"], "unknown config key 'lenghts'; did you mean 'lengths'? (in override 'lenghts=...'"),
        (["variant=double"], "variant='double' is not one of"),
        (["samples=many"], "samples"),
        (["lengths=[256,512]", "score_len=256"], "score_len=256 must be below the shortest length (256 in lengths="),
        (["ppl_documents=files"], "ppl_documents='files' is not one of ('documents', 'windows')"),
        (["value_kind=hex"], "value_kind='hex' is not one of ('number', 'uuid')"),
        (["lengths=[64,1048576]", "score_len=32", f"data={ROOT / 'README.md'}"], "no document holds 1048576 tokens"),
    ],
)
def test_eval_errors_name_the_key(tiny_export, tmp_path, capsys, args, message):
    rc = _launch("eval")(["--checkpoint", str(tiny_export), "--task", "ppl", "--out", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_not_an_export(tmp_path, capsys):
    rc = _launch("eval")(["--checkpoint", str(tmp_path), "--task", "ppl", "--out", str(tmp_path / "o")])
    assert rc == 2 and "is not a model export (missing config.json, model.safetensors)" in capsys.readouterr().err


def test_yaml_config_files_load():
    for path in sorted((ROOT / "configs" / "eval").glob("*.yaml")):
        load_eval_config(str(path), [], task=next((t for t in TASKS if path.stem.startswith(t)), None))
    with pytest.raises(ConfigError, match="config file not found"):
        load_eval_config("/nonexistent.yaml", [])


def test_generate_streams_text(tiny_export, capsys):
    rc = _launch("generate")(
        ["--checkpoint", str(tiny_export), "--prompt", "Hello", "--max-new-tokens", "5", "--top-k", "20", "--seed", "3"]
    )
    first = capsys.readouterr().out
    assert rc == 0 and first.endswith("\n")
    _launch("generate")(
        ["--checkpoint", str(tiny_export), "--prompt", "Hello", "--max-new-tokens", "5", "--top-k", "20", "--seed", "3"]
    )
    assert capsys.readouterr().out == first  # seeded sampling is reproducible

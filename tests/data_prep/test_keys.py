"""``--keys`` on the prep, train and eval command lines, and `describe_keys` that they all print with."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import MISSING

from data_prep import cli as prep_cli
from data_prep.config import PrepConfig
from data_prep.schema import INTERNAL, describe_keys
from pipeline.cli import eval as eval_cli
from pipeline.cli import train as train_cli
from pipeline.evaluation.config import EvalConfig
from pipeline.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]

CLIS = {
    "prep": (prep_cli.main, PrepConfig),
    "train": (train_cli.main, TrainConfig),
    "eval": (eval_cli.main, EvalConfig),
}


def leaf_keys(cls: type, prefix: str = "") -> tuple[list[str], list[str]]:
    """(dotted keys of every user-settable leaf field, dotted keys of every internal field), walked independently."""
    hints = typing.get_type_hints(cls)
    leaves: list[str] = []
    internal: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.metadata.get("internal"):
            internal.append(key)
        elif dataclasses.is_dataclass(hints[f.name]):
            sub_leaves, sub_internal = leaf_keys(hints[f.name], f"{key}.")
            leaves += sub_leaves
            internal += sub_internal
        else:
            leaves.append(key)
    return leaves, internal


def entries(text: str) -> dict[str, tuple[str, str, str]]:
    """Key -> (type, default, docstring) parsed from `describe_keys` output."""
    out: dict[str, tuple[str, str, str]] = {}
    key = None
    for line in text.splitlines():
        head = re.fullmatch(r"(\S+) \((.+)\) = (.*)", line)
        if head:
            key = head[1]
            out[key] = (head[2], head[3], "")
        elif key is not None and line.startswith("    "):
            typ, default, doc = out[key]
            out[key] = (typ, default, (doc + " " + line.strip()).strip())
        elif not line.strip() or line.startswith("["):
            key = None if line.startswith("[") else key
    return out


def run_keys(capsys: pytest.CaptureFixture[str], which: str) -> str:
    main, _ = CLIS[which]
    with pytest.raises(SystemExit) as stop:
        main(["--keys"])
    assert stop.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


@pytest.mark.parametrize("which", sorted(CLIS))
def test_keys_lists_every_leaf_key_and_no_internal_one(capsys, which):
    _, schema = CLIS[which]
    listed = entries(run_keys(capsys, which))
    leaves, internal = leaf_keys(schema)
    assert leaves, "the schema walk found keys"
    assert set(listed) == set(leaves)  # every leaf key, each once, and nothing else (no section as a key)
    assert not set(internal) & set(listed)


def test_prep_keys_shows_docstring_default_and_nested_keys(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = run_keys(capsys, "prep")
    listed = entries(text)
    assert listed["tokenizer.sample_bytes"] == (
        "int",
        "100000000",
        "About how many bytes of text to train on; documents are sampled by content hash.",
    )
    assert listed["output"][1] == "(required)"  # omegaconf MISSING
    assert listed["input"][1] == "[]"  # a default_factory, shown as its value
    assert listed["tokenizer.model"][:2] == ("str | None", "null")
    assert listed["tokenizer.model_type"][:2] == ("Literal['bpe', 'unigram']", '"bpe"')
    assert listed["tokenizer.type"][:2] == ("Literal['sentencepiece', 'hf']", '"sentencepiece"')
    assert listed["tokenizer.path"][:2] == ("str | None", "null")
    assert (
        "[tokenizer]\n    Which tokenizer produces the tokens: a SentencePiece model" in text
    )  # the section's class doc
    assert "env_interpolations" not in text  # INTERNAL
    assert list(tmp_path.iterdir()) == []  # no work done: nothing written


def test_train_keys_needs_no_config(capsys):
    listed = entries(run_keys(capsys, "train"))
    assert listed["train.max_steps"] == (
        "int",
        "100",
        "Optimizer steps of the whole run; the LR schedule is pinned to it.",
    )
    assert listed["run_dir"][1] == "(required)"
    assert listed["model.groups"][:2] == ("list[int]", "[2]")
    assert listed["model.d_model"][2] == "Hidden size."


def test_train_without_config_or_keys_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as stop:
        train_cli.main([])
    assert stop.value.code == 2
    assert "the following arguments are required: --config" in capsys.readouterr().err


def test_eval_keys_needs_no_checkpoint_and_finds_inherited_docstrings(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    listed = entries(run_keys(capsys, "eval"))
    assert listed["score_len"] == (
        "int | None",
        "null",
        "ppl: the final tokens of each document scored at every context length (default: half the shortest length, "
        "at most 1024; ``pipeline.evaluation.ppl.default_score_len``).",
    )
    assert listed["lengths"][1] == "[2048, 4096, 16384]"  # a default_factory lambda
    assert listed["key_digits"] == ("int", "5", "passkey: digits of the key.")  # declared in NeedleSpec, the base
    assert listed["seed"] == ("int", "0", "")  # no docstring: still listed
    assert list(tmp_path.iterdir()) == []


def test_eval_without_keys_still_needs_its_options(capsys):
    with pytest.raises(SystemExit) as stop:
        eval_cli.main(["--task", "ppl"])
    assert stop.value.code == 2
    assert "the following arguments are required: --checkpoint, --out" in capsys.readouterr().err


def test_launch_prep_keys_as_a_subprocess(tmp_path):
    """The launcher exits 0 and prints the keys; it writes nothing where it runs."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "prep.py"), "--keys"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer.vocab_size (int | None) = null" in proc.stdout
    assert list(tmp_path.iterdir()) == []


# -- describe_keys on a hand-made schema ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Inner:
    """The inner section."""

    depth: int = 3
    """How deep it goes."""
    names: list[str] = field(default_factory=lambda: ["a", "b"])


@dataclass
class _Base:
    inherited: float = 0.5
    """Declared in the base class only."""


@dataclass
class _Schema(_Base):
    path: str = MISSING
    """Where it goes,
    over two lines."""
    exact: int = dataclasses.field(default=7)
    """Seven."""
    inner: _Inner = field(default_factory=_Inner)
    hidden: dict[str, str] = field(default_factory=dict, metadata=INTERNAL)
    """Set by the program."""
    last: bool | None = None


def test_describe_keys_on_a_small_schema():
    text = describe_keys(_Schema)
    listed = entries(text)
    assert set(listed) == {"inherited", "path", "exact", "last", "inner.depth", "inner.names"}
    assert listed["inherited"] == ("float", "0.5", "Declared in the base class only.")
    assert listed["path"] == ("str", "(required)", "Where it goes, over two lines.")
    assert "path (str) = (required)\n    Where it goes,\n    over two lines.\n" in text  # indented, lines kept
    assert listed["exact"] == ("int", "7", "Seven.")
    assert listed["last"] == ("bool | None", "null", "")
    assert listed["inner.depth"] == ("int", "3", "How deep it goes.")
    assert listed["inner.names"] == ("list[str]", '["a", "b"]', "")  # default_factory shown as its value
    assert "[inner]\n    The inner section.\n" in text
    assert "hidden" not in text and "Set by the program" not in text
    assert text.index("last (") < text.index("[inner]")  # a section's own keys first, then its subsections


def test_describe_keys_without_source_still_lists_keys():
    """A schema made at run time has no source to read docstrings from: its keys are still listed."""
    made = dataclasses.make_dataclass("Made", [("b", str), ("a", int, dataclasses.field(default=1))])
    listed = entries(describe_keys(made))
    assert listed == {"a": ("int", "1", ""), "b": ("str", "(required)", "")}

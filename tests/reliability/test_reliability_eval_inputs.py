"""The eval jobs refuse bad input before any work, never lose a finished result, and keep environment values out.

Every refusal is checked the same way: exit code 2, exactly one ``error:`` line on stderr naming the key, file or
value, and neither the model load (where the check comes first) nor the evaluation itself ever called -- spies
replace them and fail the test if they run. Results are compared with a second, undisturbed run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from reliability_harness import REPO

from model import GCAForCausalLM, load_pretrained, save_pretrained
from model.io import ExportError
from pipeline.evaluation import run as eval_run

pytestmark = pytest.mark.reliability

SECRET = "s3cr3t-Q7v9Xk2"
"""Part of every environment value below: it must never be printed or written."""


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}_inputs", REPO / "launch" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


EVAL, GENERATE = _cli("eval"), _cli("generate")


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init export with the byte tokenizer (no tokenizer file), the way the trainer writes one."""
    torch.manual_seed(0)
    cfg = tiny_config()
    return save_pretrained(
        GCAForCausalLM(cfg).eval(), tmp_path_factory.mktemp("eval_inputs") / "export", extra={"train_seq_len": 64}
    )


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if an evaluation starts."""

    def ran(*args, **kwargs):
        raise AssertionError("the evaluation ran although the input was bad")

    monkeypatch.setattr(eval_run, "context_ppl", ran)
    monkeypatch.setattr(eval_run, "evaluate_passkey", ran)


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch, no_work: None) -> None:
    """Fail the test if the export is even loaded."""

    def loaded(*args, **kwargs):
        raise AssertionError("the export was loaded although the input was bad")

    monkeypatch.setattr(eval_run, "load_checkpoint", loaded)


def _one_error_line(err: str) -> str:
    """The only line of ``err``, which must be an ``error:`` line (no traceback, no second line)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def _eval(export: Path, out: Path, *args: str, task: str = "ppl") -> int:
    scored = ["score_len=32"] if task == "ppl" else []  # below the 64-token lengths these tests evaluate
    return EVAL(["--checkpoint", str(export), "--task", task, "--out", str(out), "progress=false", *scored, *args])


def _rows(result: dict) -> list[dict]:
    """Result rows without the timings, which differ between runs."""
    return [{k: v for k, v in row.items() if k not in ("seconds", "tokens_per_s")} for row in result["results"]]


# --- the output location ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["out_is_a_file", "out_under_a_file", "result_path_is_a_directory"])
def test_out_that_cannot_take_the_result_is_refused_before_any_work(case, export, tmp_path, capsys, no_load):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    out = {"out_is_a_file": blocker, "out_under_a_file": blocker / "sub", "result_path_is_a_directory": tmp_path}[case]
    if case == "result_path_is_a_directory":
        (tmp_path / "ppl.json").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _eval(export, out, "lengths=[64]", "samples=1") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--out {out}" in line
    assert blocker.read_text() == "not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created, nothing removed


@pytest.mark.parametrize("case", ["prepared_dataset", "text_data_dir"])
def test_out_inside_input_data_is_refused(case, export, tmp_path, capsys, no_load):
    """Results never go into a dataset (marked by _COMPLETE + manifest.json) or into the ``data`` directory, which
    would read them back as documents on the next run."""
    data = tmp_path / "data"
    data.mkdir()
    if case == "prepared_dataset":
        (data / "_COMPLETE").write_text("0" * 64)
        (data / "manifest.json").write_text("{}")
        source = "data=builtin"
    else:
        (data / "story.txt").write_text("A quiet river ran under the old bridge. " * 10)
        source = f"data={data}"
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    assert _eval(export, data / "results", "lengths=[64]", source) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--out {data / 'results'}: lies inside the dataset or data directory {data}" in line
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_a_failed_eval_keeps_the_previous_result_and_leaves_no_directory(export, tmp_path, monkeypatch, capsys):
    """A result is replaced only by a finished one (temp file + rename); a directory the run created is removed
    again when the run fails."""
    old = tmp_path / "old"
    assert _eval(export, old, "lengths=[64]", "samples=1") == 0
    before = (old / "ppl.json").read_bytes()

    def broken(*args, **kwargs):
        raise ValueError("the haystack ran dry")

    monkeypatch.setattr(eval_run, "context_ppl", broken)
    assert _eval(export, old, "lengths=[64]", "samples=1") == 2
    assert (old / "ppl.json").read_bytes() == before
    assert sorted(p.name for p in old.iterdir()) == ["ppl.json", "ppl.png"]  # no temp files left
    assert _eval(export, tmp_path / "new" / "deeper", "lengths=[64]", "samples=1") == 2
    assert not (tmp_path / "new").exists()
    assert "the haystack ran dry" in capsys.readouterr().err


def test_a_finished_result_survives_an_output_directory_that_vanished(export, tmp_path, monkeypatch, capsys):
    """The output directory is replaced by a file while the eval runs: the result goes to a temp file, the error
    names it, and it holds exactly what an undisturbed run computes."""
    assert _eval(export, tmp_path / "reference", "lengths=[64]", "samples=2") == 0
    reference = json.loads((tmp_path / "reference" / "ppl.json").read_text())
    out, real = tmp_path / "out", eval_run.context_ppl

    def then_vanish(*args, **kwargs):
        rows = real(*args, **kwargs)
        shutil.rmtree(out)
        out.write_text("someone else's file\n")
        return rows

    monkeypatch.setattr(eval_run, "context_ppl", then_vanish)
    rescue_dir = tmp_path / "system_tmp"
    rescue_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(rescue_dir))
    assert _eval(export, out, "lengths=[64]", "samples=2") == 1
    line = _one_error_line(capsys.readouterr().err)
    [rescued] = list(rescue_dir.glob("gca-eval-ppl-*.json"))
    assert f"could not write {out / 'ppl.json'}" in line and f"saved to {rescued}" in line
    assert _rows(json.loads(rescued.read_text())) == _rows(reference)
    assert out.read_text() == "someone else's file\n"


# --- passkey templates and numeric keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["needle= The pass key is 12345. "], ["needle=", "lacks the placeholder(s) {key}"]),
        (["answer= 12345"], ["answer=", "lacks the placeholder(s) {key}"]),
        (["variant=multikey", "question= What is the special magic number?"], ["question=", "{name}"]),
        (["variant=multihop", 'link=" {name} leads somewhere. "'], ["link=", "{next}"]),
        (["needle= The pass key is {key. "], ["needle=", "expected '}'"]),
        (["question= What is the pass key {key}?"], ["question=", "unknown placeholder(s) {key}"]),
        (['link=" {name} leads to {next}. "'], ["link=", "only variant=multihop"]),
        (['needle="  "'], ["needle=", "is empty"]),
        (["needle= The pass key is: {key}. "], ["needle=", "not a valid value", "quote text"]),
        (["answer={key}"], ["answer: ", "quote text"]),
    ],
)
def test_passkey_template_without_its_placeholder_is_refused(args, fragments, export, tmp_path, capsys, no_load):
    assert _eval(export, tmp_path / "out", "lengths=[256]", "samples=1", *args, task="passkey") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert all(f in line for f in fragments), line
    assert not (tmp_path / "out").exists()


def test_custom_templates_with_their_placeholders_run(export, tmp_path):
    """The control for the refusals above: the same keys, with placeholders, evaluate."""
    args = [
        'needle=" The code word is {key}. "',
        'question=" What is the code word? The code word is"',
        'answer=" {key}"',
        "depths=[0.5]",
    ]
    assert _eval(export, tmp_path / "out", "lengths=[256]", "samples=1", *args, task="passkey") == 0
    result = json.loads((tmp_path / "out" / "passkey.json").read_text())
    assert result["config"]["needle"] == " The code word is {key}. " and result["results"][0]["n"] == 1


@pytest.mark.parametrize(
    ("arg", "fragment"),
    [
        ("lengths=[0]", "lengths=[0]"),
        ("lengths=[-64]", "lengths=[-64]"),
        ("samples=0", "samples=0"),
        ("samples=-3", "samples=-3"),
        ("segment=0", "segment=0"),
        ("depths=[nan]", "depths=[nan]"),
        ("depths=[inf]", "depths=[inf]"),
        ("depths=[1.5]", "depths=[1.5]"),
        ("depths=[-0.1]", "depths=[-0.1]"),
        ("key_digits=0", "key_digits=0"),
        ("key_digits=19", "key_digits=19"),
        ("needles=0", "needles=0"),
        ("seed=-1", "seed=-1"),
        ("offload_mb=-2", "offload_mb=-2"),
        ("offload_dir=/nonexistent/spill", "offload_dir='/nonexistent/spill'"),
        ("device=gpu", "device='gpu'"),
        ("samples=1.5", "samples"),
        ("lengths=[inf]", "lengths"),
    ],
)
def test_bad_numbers_and_values_name_key_and_value(arg, fragment, export, tmp_path, capsys, no_load):
    assert _eval(export, tmp_path / "out", "lengths=[256]", arg, task="passkey") == 2
    assert fragment in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arg", "fragment"),
    [
        ("--temperature=nan", "temperature=nan"),
        ("--temperature=-1", "temperature=-1"),
        ("--top-p=0", "top_p=0"),
        ("--top-k=-1", "top_k=-1"),
        ("--max-new-tokens=0", "--max-new-tokens 0"),
        ("--offload-mb=-5", "--offload-mb -5"),
        ("--device=gpu", "'gpu'"),
    ],
)
def test_generate_checks_its_options_before_loading(arg, fragment, export, capsys, monkeypatch):
    loads = []
    monkeypatch.setitem(GENERATE.__globals__, "load_checkpoint", lambda *a, **k: loads.append(a))
    assert GENERATE(["--checkpoint", str(export), "--prompt", "Hello", arg]) == 2
    assert fragment in _one_error_line(capsys.readouterr().err) and loads == []


# --- the --config file -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- 1024\n- 4096\n", "the top level must be a mapping"),
        ("4096\n", "the top level must be a mapping"),
        ("lengths: [1024,\n", "not valid YAML"),
        (b"\xff\xfe\x00lengths", "not UTF-8"),
        ("lenghts: [1024]\n", "unknown config key 'lenghts'; did you mean 'lengths'?"),
    ],
)
def test_config_file_that_is_not_a_mapping_of_keys_is_one_line(text, fragment, export, tmp_path, capsys, no_load):
    config = tmp_path / "eval.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert (
        EVAL(["--checkpoint", str(export), "--task", "ppl", "--out", str(tmp_path / "out"), "--config", str(config)])
        == 2
    )
    line = _one_error_line(capsys.readouterr().err)
    assert f"config file {config}" in line and fragment in line


# --- damaged or foreign exports --------------------------------------------------------------------------------


class Payload:
    """Unpickling this would ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _damage(export: Path, case: str, marker: Path) -> str:
    """Damage a copy of an export; returns the file the error must name."""
    weights, config = export / "model.safetensors", export / "config.json"
    if case == "garbage_weights":
        weights.write_bytes(os.urandom(4096))
    elif case == "pickle_renamed":
        torch.save({"model": Payload(marker)}, weights)
    elif case == "bare_pickle_renamed":
        weights.write_bytes(pickle.dumps(Payload(marker)))
    elif case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:5000])
    elif case == "empty_weights":
        weights.write_bytes(b"")
    elif case == "trailing_bytes":
        weights.write_bytes(weights.read_bytes() + b"\0" * 64)
    elif case == "weights_of_another_model":
        payload = json.loads(config.read_text())
        payload["model"]["d_model"] = 128
        config.write_text(json.dumps(payload))
    elif case == "config_missing":
        config.unlink()
    elif case == "config_not_json":
        config.write_text("{model: not json")
    elif case == "config_a_list":
        config.write_text("[1, 2]")
    elif case == "config_model_not_an_object":
        config.write_text('{"model": [1]}')
    elif case == "config_not_utf8":
        config.write_bytes(b"\xff\xfe\x00\x01")
    elif case == "config_export_not_an_object":
        config.write_text(json.dumps({**json.loads(config.read_text()), "export": [1]}))
    elif case == "config_bad_model_value":
        payload = json.loads(config.read_text())
        payload["model"]["window"] = -4
        config.write_text(json.dumps(payload))
    else:
        assert case == "tokenizer_not_sentencepiece"
        config.write_text(json.dumps({**json.loads(config.read_text()), "export": {"tokenizer": "tok.model"}}))
        (export / "tok.model").write_bytes(pickle.dumps(Payload(marker)))
        return "tok.model"
    return "config.json" if case.startswith("config") else "model.safetensors"


EXPORT_DAMAGE = [
    "garbage_weights",
    "pickle_renamed",
    "bare_pickle_renamed",
    "truncated_weights",
    "empty_weights",
    "trailing_bytes",
    "weights_of_another_model",
    "config_missing",
    "config_not_json",
    "config_a_list",
    "config_model_not_an_object",
    "config_not_utf8",
    "config_export_not_an_object",
    "config_bad_model_value",
    "tokenizer_not_sentencepiece",
]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("case", EXPORT_DAMAGE)
def test_damaged_export_is_one_line_naming_the_file(case, export, tmp_path, capsys, no_work):
    damaged = Path(shutil.copytree(export, tmp_path / "export"))
    marker = tmp_path / "MARKER"
    name = _damage(damaged, case, marker)
    assert _eval(damaged, tmp_path / "out", "lengths=[64]") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(damaged / name) in line or f"{damaged} is not a model export (missing {name})" in line, line
    assert GENERATE(["--checkpoint", str(damaged), "--prompt", "Hello"]) == 2
    assert _one_error_line(capsys.readouterr().err) == line
    if name != "tok.model":  # the model loader on its own gives the same clear error
        with pytest.raises((ExportError, FileNotFoundError), match=name):
            load_pretrained(damaged)
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_export_with_a_non_finite_weight_is_one_line_naming_the_tensor(bad, export, tmp_path, capsys, no_work):
    """A NaN or infinite weight (a diverged run's export) is refused at load by eval, generate and
    ``load_pretrained``, naming the file and the tensor, instead of NaN rows or a sampling traceback."""
    from safetensors.torch import load_file, save_file

    damaged = Path(shutil.copytree(export, tmp_path / "export"))
    tensors = load_file(damaged / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]  # a tensor deep in the file, not just the first one read
    tensors[name].view(-1)[-1] = bad
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    assert _eval(damaged, tmp_path / "out", "lengths=[64]") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(damaged / "model.safetensors") in line and f"tensor {name} " in line, line
    assert GENERATE(["--checkpoint", str(damaged), "--prompt", "Hello"]) == 2
    assert _one_error_line(capsys.readouterr().err) == line
    with pytest.raises(ExportError, match=f"tensor {name} "):
        load_pretrained(damaged)
    assert not (tmp_path / "out").exists()


# --- environment values stay out of output, results and errors -------------------------------------------------


def _files_text(root: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in root.rglob("*") if p.is_file())


@pytest.fixture
def secret_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A haystack file whose path holds the secret, named by ``GCA_EVAL_DATA``."""
    corpus = tmp_path / f"corpus-{SECRET}.txt"
    corpus.write_text("A quiet river ran under the old bridge in the evening. " * 20)
    monkeypatch.setenv("GCA_EVAL_DATA", str(corpus))
    return corpus


def test_environment_values_never_reach_output_or_results(export, secret_corpus, tmp_path, capsys, caplog):
    """``data=${oc.env:...}`` on the command line (in-process, logs captured) and in a --config YAML (a real
    process): the eval runs and gives the numbers of the literal path, and the value is nowhere -- stdout, stderr,
    the logs, the JSON (which keeps the interpolation, so it re-runs) or the plot."""
    caplog.set_level(logging.INFO)
    assert _eval(export, tmp_path / "reference", f"data={secret_corpus}", "lengths=[64]", "samples=2") == 0
    reference = json.loads((tmp_path / "reference" / "ppl.json").read_text())
    capsys.readouterr()
    caplog.clear()
    cli = tmp_path / "out_cli"
    assert _eval(export, cli, "data=${oc.env:GCA_EVAL_DATA}", "lengths=[64]", "samples=2") == 0
    printed = capsys.readouterr()
    assert "loaded" in caplog.text  # the logs were captured, so the secret's absence from them means something
    assert SECRET not in printed.out + printed.err + caplog.text + _files_text(cli)

    config = tmp_path / "eval.yaml"
    config.write_text("data: ${oc.env:GCA_EVAL_DATA}\nlengths: [64]\nscore_len: 32\nsamples: 2\n")
    process = tmp_path / "out_process"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/eval.py"),
            "--checkpoint",
            str(export),
            "--task",
            "ppl",
            "--out",
            str(process),
            "--config",
            str(config),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0 and "loaded" in proc.stderr, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr + _files_text(process)
    for out in (cli, process):
        result = json.loads((out / "ppl.json").read_text())
        assert result["config"]["data"] == "${oc.env:GCA_EVAL_DATA}"
        assert _rows(result) == _rows(reference)


def test_environment_values_never_reach_errors(export, tmp_path, capsys, caplog, monkeypatch):
    """A bad number and a missing file, both from the environment: a clear one-line error showing the
    interpolation, never the value; with ``GCA_SHOW_ENV_VALUES=1`` the value shows (the control that this test
    sees a leak)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("GCA_EVAL_SAMPLES", f"many-{SECRET}")
    monkeypatch.setenv("GCA_EVAL_DATA", str(tmp_path / f"missing-{SECRET}.txt"))
    cases = {
        "samples=${oc.env:GCA_EVAL_SAMPLES}": "config key 'samples' has a wrong value",
        "data=${oc.env:GCA_EVAL_DATA}": "is not a file",
    }
    for arg, fragment in cases.items():
        assert _eval(export, tmp_path / "out", "lengths=[64]", arg) == 2
        printed = capsys.readouterr()
        line = _one_error_line(printed.err)
        assert fragment in line and "${oc.env:" in line, line
        assert SECRET not in printed.out + printed.err + caplog.text
        assert not (tmp_path / "out").exists()
    monkeypatch.setenv("GCA_SHOW_ENV_VALUES", "1")
    assert _eval(export, tmp_path / "out", "lengths=[64]", "samples=${oc.env:GCA_EVAL_SAMPLES}") == 2
    assert SECRET in _one_error_line(capsys.readouterr().err)


# --- what a length costs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["passkey", "ruler"])
def test_a_length_no_host_can_hold_is_one_line_before_the_export_loads(task, export, tmp_path, capsys, no_load):
    """10^12 tokens: their int64 ids alone are 7.3 TiB (before: numpy's 'Unable to allocate 931 GiB' traceback)."""
    assert _eval(export, tmp_path / "out", "lengths=[1000000000000]", task=task) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "lengths=[1000000000000]" in line and "memory" in line and "GiB" in line
    assert not (tmp_path / "out").exists()


def test_chunk_memory_past_offload_mb_must_fit_the_free_disk_of_offload_dir(export, tmp_path, capsys, monkeypatch):
    """The chunk K/V past ``offload_mb`` spill to ``offload_dir``: 2 (K and V) x 4 bytes (fp32) x d_model per
    token (written out here as the reference); a disk with less free space than that is refused by name, one with
    as much runs."""
    from pipeline.data import host_memory

    cfg = tiny_config()
    length, offload_mb = 1 << 20, 1
    spill = 2 * 4 * cfg.d_model * length - (offload_mb << 20)
    loads: list[str] = []

    def loaded(checkpoint, *args, **kwargs):
        loads.append(checkpoint)
        raise OSError("stub: the check passed and the export would load now")

    monkeypatch.setattr(eval_run, "load_checkpoint", loaded)
    args = [f"lengths=[{length}]", f"offload_mb={offload_mb}", f"offload_dir={tmp_path}"]
    monkeypatch.setattr(host_memory, "free_disk_bytes", lambda path: spill - 1)
    assert _eval(export, tmp_path / "out", *args, task="passkey") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"offload_dir={tmp_path}" in line and f"lengths=[{length}]" in line and not loads
    monkeypatch.setattr(host_memory, "free_disk_bytes", lambda path: spill)
    with pytest.raises(OSError, match="stub"):
        _eval(export, tmp_path / "out", *args, task="passkey")
    assert loads == [str(export)]

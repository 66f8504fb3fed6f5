"""T18 (no load path runs a crafted pickle) and T19 (secrets never reach logs, configs, checkpoints or wandb).

Every crafted file below would ``touch MARKER`` if unpickled. The attacker controls the whole directory, so the
integrity manifest is rewritten to match: these tests prove the unpickling defences, not the hash check.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import pickle
import re
import runpy
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from reliability_harness import REPO, overrides

from model import load_pretrained
from pipeline.train import dist
from pipeline.train.checkpoint import write_integrity
from pipeline.train.trainer import NonFiniteError, main

pytestmark = pytest.mark.reliability


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(path: Path, marker: Path, as_torch: bool = True) -> None:
    """Replace ``path`` with a payload (inside a torch zip archive, like a real .pt, or as a bare pickle)."""
    if as_torch:
        torch.save({"model": Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))
    assert marker.exists() is False


def _reseal(ckpt: Path) -> None:
    """Rewrite the integrity manifest, as an attacker with write access would."""
    write_integrity(ckpt, dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(None, overrides(run, data, **{"train.max_steps": 4, "checkpoint.export": True})) == 0
    return run


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the bare-pickle case, refused all the same
@pytest.mark.parametrize("target, as_torch", [("state.pt", True), ("state.pt", False), ("rng_rank0.pt", True)])
def test_t18_crafted_torch_files_in_a_checkpoint_never_run(target, as_torch, trained, data, tmp_path, caplog):
    """The only checkpoint is crafted, so there is none to fall back to: one line, exit 2, nothing moved."""
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    ckpt = run / "checkpoints/step_00000004"
    marker = tmp_path / "MARKER"
    _plant(ckpt / target, marker, as_torch)
    _reseal(ckpt)
    refused = rf"{target}: refusing to load: (.*GLOBAL posix\.system|Unsupported operand)"
    with caplog.at_level(logging.ERROR):
        assert main(None, overrides(run, data, **{"train.max_steps": 8})) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert re.search(refused, line) and "no committed checkpoint in" in line, line
    assert not marker.exists() and ckpt.is_dir()


def test_t18_crafted_dcp_metadata_in_a_user_supplied_checkpoint_never_runs(data, tmp_path, caplog):
    """FSDP2 checkpoints are DCP, whose .metadata DCP reads with plain pickle: a user-supplied
    ``checkpoint.resume=<dir>`` with a crafted .metadata is refused by the restricted unpickler first."""
    run = tmp_path / "run"
    fsdp = {"parallel.engine": "fsdp", "train.max_steps": 4}
    assert main(None, overrides(run, data, **fsdp)) == 0
    given = Path(shutil.copytree(run / "checkpoints/step_00000004", tmp_path / "downloaded_ckpt"))
    marker = tmp_path / "MARKER"
    (given / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(given)
    with caplog.at_level(logging.ERROR):
        resumed = overrides(
            tmp_path / "new_run", data, **{**fsdp, "train.max_steps": 8, "checkpoint.resume": str(given)}
        )
        assert main(None, resumed) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert re.search(r"\.metadata: refusing to unpickle global posix\.system", line), line
    assert not marker.exists()


def test_t18_eval_loads_safetensors_and_json_only(trained, tmp_path, capsys):
    """An export with a crafted .pt/.bin beside (or instead of) model.safetensors: the eval loader ignores it,
    or fails for lack of safetensors weights; nothing is unpickled."""
    marker = tmp_path / "MARKER"
    export = Path(shutil.copytree(trained / "export", tmp_path / "export"))
    for name in ("pytorch_model.bin", "model.pt", "optimizer.pkl"):
        _plant(export / name, marker)
    load_pretrained(export)  # model.safetensors + config.json only
    (export / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(export)
    spec = importlib.util.spec_from_file_location("launch_eval", REPO / "launch/eval.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--checkpoint", str(export), "--task", "ppl", "--out", str(tmp_path / "out")]) == 2
    assert not marker.exists()


_PACKAGES = ("kernels", "model", "pipeline", "data_prep", "launch")
_PICKLE_ALLOWED = {"pipeline/train/checkpoint.py"}
"""Modules allowed to touch the pickle machinery: the restricted (allowlist) unpickler lives there."""


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_t18_lint_no_unrestricted_unpickling_in_the_code():
    """Every ``torch.load`` passes ``weights_only=True``; no module but the allowlisted one uses pickle, dill,
    cloudpickle, joblib or ``numpy.load(allow_pickle=True)``."""
    problems = []
    for package in _PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    for name in names:
                        if (
                            name.split(".")[0] in ("pickle", "dill", "cloudpickle", "joblib", "_pickle")
                            and rel not in _PICKLE_ALLOWED
                        ):
                            problems.append(f"{rel}:{node.lineno}: imports {name}")
                    if (
                        isinstance(node, ast.ImportFrom)
                        and node.module == "torch"
                        and any(a.name == "load" for a in node.names)
                    ):
                        problems.append(f"{rel}:{node.lineno}: from torch import load (call torch.load visibly)")
            for node, name in _calls(tree):
                kwargs = {k.arg: k.value for k in node.keywords}
                if name.endswith("torch.load"):
                    value = kwargs.get("weights_only")
                    if not (isinstance(value, ast.Constant) and value.value is True):
                        problems.append(f"{rel}:{node.lineno}: {name}(...) without weights_only=True")
                if name in ("np.load", "numpy.load"):
                    value = kwargs.get("allow_pickle")
                    if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                        problems.append(f"{rel}:{node.lineno}: {name}(allow_pickle=...)")
                if "add_safe_globals" in name:
                    problems.append(f"{rel}:{node.lineno}: process-wide {name} (use a scoped safe_globals)")
    assert not problems, "\n".join(problems)


def test_t18_old_torch_is_refused_at_import(monkeypatch):
    """weights_only=True had RCE bypasses before torch 2.10; the checkpoint module refuses to import on them."""
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(ImportError, match="torch 2.5.1\\+cpu is too old.*2.10"):
        runpy.run_path(str(REPO / "pipeline/train/checkpoint.py"))


# -- T19 -----------------------------------------------------------------------------------------------------------

SECRETS = {
    "WANDB_API_KEY": "sentinel-wandb-3c9f27d1e8",
    "HF_TOKEN": "sentinel-hf-b41e7a2290",
    "AWS_SECRET_ACCESS_KEY": "sentinel-aws-9d0c55e4f1",
}


@pytest.fixture
def secrets(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    return SECRETS


def _leaks(root: Path, texts: list[str]) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        blob = path.read_bytes()
        found += [f"{path}: {name}" for name, value in SECRETS.items() if value.encode() in blob]
    for i, text in enumerate(texts):
        found += [f"captured output #{i}: {name}" for name, value in SECRETS.items() if value in text]
    return found


def test_t19_secrets_never_leak_into_logs_checkpoints_or_wandb(secrets, data, tmp_path, capfd, caplog, monkeypatch):
    run = tmp_path / "run"
    extra = {
        "train.max_steps": 3,
        "logging.wandb": True,
        "logging.wandb_mode": "offline",
        "checkpoint.every": 2,
        "checkpoint.export": True,
    }
    with caplog.at_level(logging.DEBUG):
        assert main(None, overrides(run, data, **extra)) == 0
        monkeypatch.setenv("PIPE_FAULT", "nan_loss:step=4")
        with pytest.raises(NonFiniteError) as crash:
            main(None, overrides(run, data, **{**extra, "train.max_steps": 6}))
    tb = "".join(traceback.format_exception(crash.value))
    out, err = capfd.readouterr()
    assert list((run / "wandb").glob("offline-run-*")), "wandb ran (offline)"
    assert (run / "checkpoints/step_00000003/trainer_state.json").is_file()
    assert _leaks(run, [out, err, caplog.text, tb]) == []


@pytest.mark.parametrize(
    "override",
    [
        "logging.wandb_project=${oc.env:WANDB_API_KEY}",
        "logging.wandb_project=prefix-${oc.env:AWS_SECRET_ACCESS_KEY}",
        f"logging.wandb_project={SECRETS['HF_TOKEN']}",
        "logging.wandb_key=abcdefgh12345",
    ],
)
def test_t19_a_secret_in_the_config_is_rejected_without_echoing_it(override, secrets, data, tmp_path, capfd, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.DEBUG):
        assert main(None, [*overrides(run, data), override]) == 2
    out, err = capfd.readouterr()
    assert "logging.wandb_" in caplog.text
    assert not run.exists(), "rejected before anything is created"
    assert _leaks(tmp_path, [out, err, caplog.text]) == []
    assert "abcdefgh12345" not in caplog.text + out + err


def test_t19_yaml_with_secret_interpolation_is_rejected(secrets, data, tmp_path, caplog):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run_dir: {tmp_path / 'run'}\ndata:\n  path: {data}\nlogging:\n  wandb_project: ${{oc.env:WANDB_API_KEY}}\n"
    )
    with caplog.at_level(logging.ERROR):
        assert main(str(config), overrides(tmp_path / "run", data)[2:]) == 2
    assert "holds the value of the environment variable WANDB_API_KEY" in caplog.text
    assert SECRETS["WANDB_API_KEY"] not in caplog.text

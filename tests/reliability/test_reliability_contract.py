"""T14 (NaN/Inf stop, one rank), T20 (config validation end to end), T23 (eval export contract, checkpoint
format back-compat). One process; the two-rank and DeepSpeed cases of T14 are in
test_reliability_failures_dist.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed
from reliability_harness import REPO, committed, overrides
from safetensors.torch import load_file

from pipeline.train import dist
from pipeline.train.checkpoint import verify_integrity
from pipeline.train.config import load_config
from pipeline.train.trainer import NonFiniteError, Trainer, main

pytestmark = pytest.mark.reliability

GOLDEN_V1 = Path(__file__).parent / "fixtures" / "golden_v1"


# -- T14 -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault, shown", [("nan_loss:step=5", "loss=nan"), ("inf_grad:step=5", "grad_norm=(inf|nan)")])
def test_t14_nonfinite_stops_before_the_update(fault, shown, data, tmp_path, monkeypatch):
    """The run stops at step 5 before the optimizer step: the error names the step and rank, nothing of step 5 is
    saved, and the weights and optimizer state in memory still equal the step-4 checkpoint."""
    run = tmp_path / "run"
    monkeypatch.setenv("PIPE_FAULT", fault)
    trainer = Trainer(load_config(None, overrides(run, data)), dist.init_distributed("none"))
    with pytest.raises(NonFiniteError, match=rf"at step 5 on rank\(s\) \[0\].*{shown}.*stopped before the optimizer"):
        trainer.train()
    assert committed(run) == ["step_00000004"]
    saved = torch.load(run / "checkpoints/step_00000004/state.pt", weights_only=True)
    live = trainer.engine.module.state_dict()
    assert all(torch.equal(live[k], saved["model"][k]) for k in saved["model"])
    moments = trainer.engine.optimizer.state_dict()["state"]
    assert all(torch.equal(v, moments[p][k]) for p, s in saved["optim"]["state"].items() for k, v in s.items())
    verify_integrity(run / "checkpoints/step_00000004", trainer.info)


# -- T20 -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, drop, message",
    [
        ({"train.max_step": 5}, None, "unknown config key 'train.max_step'.*did you mean 'train.max_steps'"),
        ({"optim.weight_decy": 0.1}, None, "did you mean 'optim.weight_decay'"),
        ({"train.global_batch": "8x"}, None, "config key 'train.global_batch' has a wrong value"),
        ({}, "data.path", "config key 'data.path' is required"),
        ({"train.global_batch": 6, "train.micro_batch": 4}, None, "train.global_batch=6 must be divisible by"),
        ({"model.top_k": 9}, None, "model.top_k=9 is larger than the number of chunks per sequence"),
        ({"checkpoint.keep_last": 0}, None, "checkpoint.keep_last must be >= 1"),
        ({"checkpoint.every": -1}, None, "checkpoint.every must be >= 0"),
        ({"model.d_model": 30, "model.n_heads": 4}, None, "model.d_model=30 must be divisible by model.n_heads=4"),
    ],
)
def test_t20_bad_config_fails_before_anything_starts(extra, drop, message, data, tmp_path, caplog):
    run = tmp_path / "run"
    args = [a for a in overrides(run, data, **extra) if drop is None or not a.startswith(drop + "=")]
    with caplog.at_level(logging.ERROR):
        assert main(None, args) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert not run.exists(), "no output directory"
    assert not torch.distributed.is_initialized(), "no process group"


def test_t20_keep_last_one_and_end_only_saves_are_valid(data, tmp_path):
    """Rules we deliberately do not copy: keep_last=1 is safe here (a new checkpoint commits before the old one
    is deleted), and checkpoint.every=0 means "only at the end and on a stop signal"."""
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **{"checkpoint.keep_last": 1, "checkpoint.every": 0})) == 0
    assert committed(run) == ["step_00000008"]


def test_t20_architecture_mismatch_lists_every_differing_field(data, tmp_path, caplog):
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **{"train.max_steps": 4})) == 0
    assert main(None, overrides(run, data, **{"model.window": 8, "model.ffn_hidden": 96})) == 2
    assert re.search(
        r"configuration error: cannot resume \S+step_00000004: model\.ffn_hidden: 64 -> 96 changes the architecture; "
        r"model\.window: 16 -> 8 changes the architecture; set them back",
        caplog.text,
    )


def test_t20_a_different_backend_is_not_a_different_architecture(data, tmp_path):
    """Backends choose how the same model is computed: a run resumes under another one (e.g. GPU -> CPU), and
    under the older `attn_backend` shorthand."""
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **{"train.max_steps": 4})) == 0
    assert main(None, overrides(run, data, **{"train.max_steps": 6, "model.gca_backend": "naive"})) == 0
    assert main(None, overrides(run, data, **{"train.max_steps": 8, "model.attn_backend": "sdpa"})) == 0
    assert committed(run)[-1] == "step_00000008"


# -- T23 -----------------------------------------------------------------------------------------------------------

_EVAL_SCRIPT = """
import sys
import torch
from safetensors.torch import load_file, save_file
from model import load_pretrained
export, out = sys.argv[1], sys.argv[2]
model = load_pretrained(export)
x = load_file(out + ".in")["x"]
with torch.no_grad():
    logits = model(x).logits
forbidden = sorted(m for m in sys.modules if m.split(".")[0] in ("pipeline", "deepspeed", "omegaconf", "streaming"))
assert not forbidden, forbidden
save_file({"logits": logits.contiguous()}, out)
"""


def test_t23_export_loads_in_a_fresh_process_without_trainer_code(data, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, overrides(run, data, **{"train.max_steps": 4})), dist.init_distributed("none"))
    assert trainer.train() == 0
    export = run / "export"
    weights = load_file(export / "model.safetensors")
    live = trainer.engine.module.state_dict()
    assert weights.keys() == live.keys() and all(torch.equal(weights[k], live[k]) for k in weights)
    x = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    from safetensors.torch import save_file

    out = tmp_path / "logits.safetensors"
    save_file({"x": x}, str(out) + ".in")
    proc = subprocess.run(
        [sys.executable, "-c", _EVAL_SCRIPT, str(export), str(out)],
        cwd=REPO,
        timeout=120,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer.engine.module.eval()
    with torch.no_grad():
        expected = trainer.engine.module(x).logits
    assert torch.equal(load_file(out)["logits"], expected), "eval logits equal the trainer's, bit for bit"


def test_t23_checkpoint_of_the_previous_release_fails_with_a_migration_error(data, tmp_path, caplog):
    """tests/reliability/fixtures/golden_v1 is a checkpoint written by the first release (format 1, commit
    8ab55d7): resuming it is an explicit version-migration error, never a silent partial load: one line, exit 2,
    and the run_dir this start made is gone again."""
    ckpt = Path(shutil.copytree(GOLDEN_V1, tmp_path / "golden"))
    assert json.loads((ckpt / "trainer_state.json").read_text())["format"] == 1
    recipe = json.loads((GOLDEN_V1 / "recipe.json").read_text())
    args = overrides(tmp_path / "run", data, **{**recipe["overrides"], "checkpoint.resume": str(ckpt)})
    assert main(None, args) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert re.fullmatch(
        r"checkpoint error: .*trainer state format 1 was written by an older release .*version migration.*", line
    )
    assert not (tmp_path / "run").exists()


# -- the fault-injection mechanism itself --------------------------------------------------------------------------


def test_fault_injection_is_off_by_default_and_strict(monkeypatch):
    from pipeline.train import faults

    assert faults.from_env() is None, "unset PIPE_FAULT: no plan, every hook is a single `is None` test"
    monkeypatch.setenv("PIPE_FAULT", "sigusr1:step=5:rank=1, exit_during_save:step=8:at=renamed")
    plan = faults.from_env()
    assert plan is not None and plan.hits("sigusr1", 5, 1) and not plan.hits("sigusr1", 5, 0)
    assert plan.find("exit_during_save", 8, 0).options == {"at": "renamed"}
    for bad in (
        "nan_los:step=3",
        "kill:rank=1",
        "kill:step=3:when=now",
        "exit_during_save:step=2:at=never",
        "signal_during_save:step=2:sig=hup",
        "hang:step=x",
    ):
        monkeypatch.setenv("PIPE_FAULT", bad)
        with pytest.raises(ValueError, match="PIPE_FAULT"):
            faults.from_env()

"""Single-process trainer on the real model: learning, exact resume, export, NaN stop, retention, wandb offline."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import load_pretrained
from pipeline.train import dist
from pipeline.train.checkpoint import OWNER_FILE, OWNER_WRITER
from pipeline.train.config import load_config, to_yaml
from pipeline.train.metrics import resolve_wandb_mode
from pipeline.train.trainer import NonFiniteError, Trainer, main

REPO = Path(__file__).resolve().parents[2]


def ckpts(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_loss_goes_down(tmp_path, tiny_data, overrides, metrics):
    run = tmp_path / "run"
    assert (
        main(
            None,
            overrides(
                run,
                tiny_data,
                **{"train.max_steps": 40, "optim.lr": 1e-2, "optim.min_lr": 1e-3, "checkpoint.export": False},
            ),
        )
        == 0
    )
    losses = [m["loss"] for m in metrics(run).values()]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 0.4, losses
    # Retrieval telemetry is logged every step (the tiny model has one retrieval group).
    last = list(metrics(run).values())[-1]
    assert last["retrieval_distance_g0"] >= 2.0 and last["retrieval_entropy_g0"] >= 0.0


def test_exact_resume_after_signal(tmp_path, tiny_data, overrides, metrics, monkeypatch):
    """Run A: 8 steps. Run B: SIGUSR1 at step 3 -> save + requeue code; relaunch -> steps 4..8. Bit-identical."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(None, overrides(a, tiny_data)) == 0
    monkeypatch.setenv("PIPE_FAULT", "sigusr1:step=3")
    assert main(None, overrides(b, tiny_data)) == 75
    assert ckpts(b) == ["step_00000003"]
    monkeypatch.delenv("PIPE_FAULT")
    assert main(None, overrides(b, tiny_data)) == 0
    ma, mb = metrics(a), metrics(b)
    assert list(mb) == list(range(1, 9))
    for step in range(1, 9):
        for key in ("loss", "grad_norm", "lr"):
            assert ma[step][key].hex() == mb[step][key].hex(), (step, key, ma[step][key], mb[step][key])
    wa, wb = load_file(a / "export/model.safetensors"), load_file(b / "export/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = torch.load(a / "checkpoints/step_00000008/state.pt", weights_only=True)
    sb = torch.load(b / "checkpoints/step_00000008/state.pt", weights_only=True)
    for (ka, va), (kb, vb) in zip(sa["optim"]["state"].items(), sb["optim"]["state"].items()):
        assert ka == kb and all(torch.equal(va[n], vb[n]) for n in va), ka
    ta = json.loads((a / "checkpoints/step_00000008/trainer_state.json").read_text())
    tb = json.loads((b / "checkpoints/step_00000008/trainer_state.json").read_text())
    assert ta["data"] == tb["data"] and ta["tokens_seen"] == tb["tokens_seen"]


def test_run_dir_keeps_the_resolved_config_and_it_reproduces_the_run_config(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    args = overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.export": False, "optim.lr": 2e-3})
    assert main(None, args) == 0
    saved = run / "config.yaml"
    assert to_yaml(load_config(str(saved), [], 1)) == to_yaml(load_config(None, args, 1)) == saved.read_text()
    assert "lr: 0.002" in saved.read_text()


def test_export_matches_trainer_logits_and_loads_without_pickle(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    cfg = load_config(None, overrides(run, tiny_data, **{"train.max_steps": 3}))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    assert trainer.train() == 0
    for export in (run / "export", run / "checkpoints/step_00000003/export"):
        names = {p.name for p in export.iterdir()}
        # the native files, plus the Hugging Face remote code (tests/hf); nothing that would be unpickled
        assert {"config.json", "model.safetensors", "tokenizer.model", "modeling_gca.py"} <= names
        assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl", ".pickle"))], names
        model = load_pretrained(export)
        x = torch.randint(0, 64, (2, 48))
        trainer.engine.module.eval()
        with torch.no_grad():
            assert torch.equal(model(x).logits, trainer.engine.module(x).logits)


def test_nan_stops_before_the_optimizer_step(tmp_path, tiny_data, overrides, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("PIPE_FAULT", "nan_loss:step=3")
    with pytest.raises(NonFiniteError, match=r"at step 3 on rank\(s\) \[0\].*stopped before the optimizer step"):
        main(None, overrides(run, tiny_data, **{"checkpoint.every": 2}))
    assert ckpts(run) == ["step_00000002"]
    assert (run / "checkpoints/step_00000002/COMMITTED").is_file()


def test_keep_last_and_uncommitted_saves_are_ignored(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    assert (
        main(
            None,
            overrides(
                run,
                tiny_data,
                **{"train.max_steps": 5, "checkpoint.every": 1, "checkpoint.keep_last": 2, "checkpoint.export": False},
            ),
        )
        == 0
    )
    assert ckpts(run) == ["step_00000004", "step_00000005"]
    again = overrides(run, tiny_data, **{"train.max_steps": 6, "checkpoint.keep_last": 2})
    # An uncommitted directory this trainer did not write: the run refuses to start and leaves it as it is.
    foreign = run / "checkpoints/step_00000009"
    foreign.mkdir()
    (foreign / "state.pt").write_bytes(b"not ours")
    assert main(None, again) == 2
    assert (foreign / "state.pt").read_bytes() == b"not ours" and ckpts(run)[-1] == "step_00000009"
    # The same leftover as an interrupted save of this trainer (its OWNER.json names the step): removed.
    (foreign / OWNER_FILE).write_text(json.dumps({"writer": OWNER_WRITER, "step": 9}))
    assert main(None, again) == 0
    assert ckpts(run) == ["step_00000005", "step_00000006"]  # resumed from 5, the torn save was removed


def test_resume_refuses_another_architecture(tmp_path, tiny_data, overrides, caplog):
    """One line, exit 2 (every row of the resume table: test_resume_check.py); without an export in the checkpoint
    the way out names the export command."""
    run = tmp_path / "run"
    assert main(None, overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.export": False})) == 0
    assert main(None, overrides(run, tiny_data, **{"train.max_steps": 4, "model.window": 8})) == 2
    ckpt = run / "checkpoints/step_00000003"
    assert (
        f"cannot resume {ckpt}: model.window: 16 -> 8 changes the architecture; set it back to resume this run, or "
        f"start a new run in another run_dir (checkpoint.init_from=<dir> after launch/export.py --checkpoint "
        f"{ckpt} --out <dir> starts it from these weights if every tensor shape still fits)"
    ) in caplog.text


def test_wandb_offline_and_no_secrets(tmp_path, tiny_data, overrides, monkeypatch):
    run = tmp_path / "run"
    secret = "sentinel-secret-7f3a9c"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(None, overrides(run, tiny_data, **{"train.max_steps": 3, "logging.wandb": True})) == 0
    assert list((run / "wandb").glob("offline-run-*"))
    for path in run.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_debug_config_runs_from_the_command_line(tmp_path, tiny_data):
    """configs/train/debug.yaml through launch/pretrain.py (model vocab shrunk to the tiny test tokenizer)."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/pretrain.py"),
            "--config",
            str(REPO / "configs/train/debug.yaml"),
            f"run_dir={run}",
            f"data.path={tiny_data}",
            "model.vocab_size=64",
            "train.max_steps=4",
            "train.eval_every=2",
            "logging.progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "git " in proc.stderr and "tokens_per_step=1024" in proc.stderr and "val_loss=" in proc.stderr
    [val_line] = [line for line in proc.stderr.splitlines() if "step 4 | val_loss=" in line]
    n = re.search(r"retrieval/far_recall_tokens=(\d+)", val_line)
    assert n and "retrieval/far_recall_random=" in val_line and f" (n={n.group(1)})" in val_line, val_line
    assert (run / "export/model.safetensors").is_file()


def test_activation_checkpointing_changes_nothing(tmp_path, tiny_data, overrides, metrics):
    plain, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    extra = {"train.max_steps": 3, "checkpoint.export": False}
    assert main(None, overrides(plain, tiny_data, **extra)) == 0
    assert main(None, overrides(ckpt, tiny_data, **extra, **{"parallel.activation_checkpointing": True})) == 0
    assert [m["loss"] for m in metrics(plain).values()] == [m["loss"] for m in metrics(ckpt).values()]


def test_init_from_starts_a_fresh_run_from_exported_weights(tmp_path, tiny_data, overrides, caplog):
    first = tmp_path / "first"
    assert main(None, overrides(first, tiny_data, **{"train.max_steps": 3})) == 0
    exported = load_file(first / "export" / "model.safetensors")
    # A new stage: other sequence length and optimizer; the weights are the export's, step and data start anew.
    extra = {"checkpoint.init_from": str(first / "export"), "train.seq_len": 32, "optim.lr": 1e-3}
    cfg = load_config(None, overrides(tmp_path / "second", tiny_data, **extra))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    state = trainer.engine.module.state_dict()
    assert trainer.step == 0 and exported.keys() == state.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in exported.items())
    fresh = Trainer(load_config(None, overrides(tmp_path / "fresh", tiny_data)), dist.init_distributed("none"))
    assert not torch.equal(fresh.engine.module.state_dict()["embed.weight"], exported["embed.weight"])
    # An export of another shape is refused before training, naming the key and both values.
    caplog.clear()
    wider = {**extra, "model.d_model": 64, "model.ffn_hidden": 128}
    assert main(None, overrides(tmp_path / "third", tiny_data, **wider)) == 2
    assert "model.d_model=64 (in override" in caplog.text and "which needs model.d_model=32" in caplog.text
    with pytest.raises(Exception, match="checkpoint.init_from must be a model export directory"):
        load_config(None, overrides(tmp_path / "fourth", tiny_data, **{"checkpoint.init_from": str(tmp_path)}))


def test_needle_answer_weight_is_a_weighted_mean_over_the_answer_tokens(tmp_path, tiny_data, overrides, metrics):
    extra = {"data.needle_mix": 1.0, "train.seq_len": 96, "model.chunk_size": 16}
    cfg = load_config(None, overrides(tmp_path / "w", tiny_data, **extra, **{"data.needle_answer_weight": 5.0}))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    x, w = trainer.batches.next_step_weighted()[0]
    # Independent reference: per-token cross-entropy, answer positions found from the weights.
    model = trainer.engine.module.eval()  # no Gumbel noise: every forward below sees the same retrieval
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(
            model(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none"
        ).view(x.shape[0], -1)
        answer = w[:, 1:] == 5.0
        assert (answer.sum(1) > 0).all() and (w[:, 1:][~answer] == 1.0).all()
        expected = (ce.sum() + 4.0 * ce[answer].sum()) / (ce.numel() + 4.0 * answer.sum())
        torch.testing.assert_close(trainer.engine.loss(x, w), expected)
        assert not torch.allclose(trainer.engine.loss(x, None), expected)
    plain = load_config(None, overrides(tmp_path / "p", tiny_data, **extra))
    assert all(w is None for _, w in Trainer(plain, dist.init_distributed("none")).batches.next_step_weighted())


@pytest.mark.parametrize(
    ("setting", "environ", "mode"),
    [
        ("auto", {"WANDB_API_KEY": "k"}, "online"),
        ("auto", {}, "offline"),
        ("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),  # pretrain.sbatch's default
        ("auto", {"WANDB_MODE": "dryrun"}, "offline"),
        ("auto", {"WANDB_MODE": "disabled"}, "disabled"),
        ("offline", {"WANDB_API_KEY": "k", "WANDB_MODE": "online"}, "offline"),  # the config key wins
    ],
)
def test_wandb_mode_honours_wandb_mode_under_auto(setting, environ, mode):
    assert resolve_wandb_mode(setting, environ) == mode


def test_a_wandb_mode_wandb_does_not_know_is_a_config_error_before_any_work(
    tmp_path, tiny_data, overrides, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    assert main(None, overrides(tmp_path / "run", tiny_data, **{"logging.wandb": True})) == 2
    assert not (tmp_path / "run").exists()

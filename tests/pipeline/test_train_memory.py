"""The trainer refuses, before any work, a run whose host memory estimate exceeds what the host can give.

Nothing here allocates what it estimates: the host's memory reading is replaced, and the trainer itself is a spy
that fails the test if a run starts after the check should have refused it (before the check existed, the run
below would have started filling an 8.6 GB shuffle window).
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TINY_TRAIN_OVERRIDES

from model import GCAConfig, GCAForCausalLM
from pipeline.data import host_memory
from pipeline.train import trainer

LONG = {
    "train.seq_len": 16777216,
    "train.micro_batch": 1,
    "train.global_batch": 1,
    "data.shuffle_scope": "window",
    "data.shuffle_window": 64,
}
"""The issue's probe: one 16M-token sequence per step, the window order's default window of 64 sequences."""


class Started(Exception):
    """The trainer was built: the memory check let the run through."""


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(*args, **kwargs):
        raise Started

    monkeypatch.setattr(trainer, "Trainer", build)


def reference_bytes(model_keys: dict) -> int:
    """The documented lower bound, written out: the shuffle window and one step's micro-batches as int64 ids,
    and (training on CPU) 16 bytes of model state per parameter, on one rank."""
    seq_len = LONG["train.seq_len"]
    ids = 8 * seq_len * (LONG["data.shuffle_window"] + LONG["train.global_batch"])
    params = sum(p.numel() for p in GCAForCausalLM(GCAConfig(**model_keys)).parameters())
    return ids + (0 if torch.cuda.is_available() else 16 * params)


def test_a_run_the_host_cannot_hold_is_one_line_before_any_work(
    tmp_path, tiny_data, overrides, monkeypatch, caplog, started
):
    model_keys = {k.removeprefix("model."): v for k, v in TINY_TRAIN_OVERRIDES.items() if k.startswith("model.")}
    model_keys["groups"] = [1]
    need = reference_bytes(model_keys)
    assert need > 8.5e9  # the window alone: 64 x 16M x 8 bytes
    run = tmp_path / "run"
    args = overrides(run, tiny_data, **LONG)
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(4 << 30, "a 4 GiB cgroup"))
    with caplog.at_level(logging.ERROR):
        assert trainer.main(None, args) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    for fragment in ("train.seq_len=16777216", "data.shuffle_window=64", "4.0 GiB (a 4 GiB cgroup)"):
        assert fragment in line, line
    assert not run.exists()
    # The estimate is what the docs say: a host with exactly that much passes the check, one byte less does not.
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(need - 1, "test"))
    assert trainer.main(None, args) == 2
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(need, "test"))
    with pytest.raises(Started):
        trainer.main(None, args)


def test_the_block_order_counts_the_global_batch_every_rank_cuts(
    tmp_path, tiny_data, overrides, monkeypatch, caplog, started
):
    """With the default data order the reader holds no window; every rank cuts the whole global batch (int64 ids)
    before it takes its share: that, plus the rank's micro-batches and the model state, is the bound."""
    keys = {**LONG, "data.shuffle_scope": "blocks", "train.global_batch": 64}
    model_keys = {k.removeprefix("model."): v for k, v in TINY_TRAIN_OVERRIDES.items() if k.startswith("model.")}
    params = sum(p.numel() for p in GCAForCausalLM(GCAConfig(**{**model_keys, "groups": [1]})).parameters())
    need = 8 * 16777216 * (64 + 64) + (0 if torch.cuda.is_available() else 16 * params)
    args = overrides(tmp_path / "run", tiny_data, **keys)
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(need - 1, "test"))
    with caplog.at_level(logging.ERROR):
        assert trainer.main(None, args) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "train.seq_len=16777216 with train.global_batch=64" in line and "the global batch the reader cuts" in line
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(need, "test"))
    with pytest.raises(Started):
        trainer.main(None, args)


def test_under_ulimit_v_the_real_reading_refuses_the_run(tmp_path, tiny_data, overrides):
    """No reading replaced: the trainer in its own process under a 4 GiB address-space limit (``ulimit -v``; the
    issue's probe ended in a numpy MemoryError traceback there) reads the limit itself and refuses in one line."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    run, config = tmp_path / "run", tmp_path / "empty.yaml"
    config.write_text("")  # every key is an override
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.train", "--config", str(config), *overrides(run, tiny_data, **LONG)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=limit,
        cwd=Path(__file__).resolve().parents[2],
    )
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "train.seq_len=16777216" in errors[0] and "(ulimit -v)" in errors[0]
    assert not run.exists()


# -- device (GPU) memory ----------------------------------------------------------------------------------------------

H200 = (141 << 30, "cuda:0 (NVIDIA H200)")
PAPER = {
    "model.d_model": 768,
    "model.n_heads": 12,
    "model.n_kv_heads": 12,
    "model.ffn_hidden": 2048,
    "model.n_lower_layers": 6,
    "model.groups": "[6]",
    "model.n_encoder_layers": 2,
}
"""The paper model's shapes (configs/train/gca_pg19_16k.yaml) with the tiny model's vocabulary."""


@pytest.mark.parametrize("arch", ["gca", "swa", "full"])
def test_the_device_bound_is_below_what_a_training_step_really_holds(arch):
    """Independent reference: torch's MemTracker, the peak bytes of live tensors (parameters, gradients, AdamW state,
    activations, temporaries) during one fp32 step of the model with activation checkpointing on. The bound must
    never exceed it (so it never refuses a run that fits); measured 21-37% of the peak at these tiny shapes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from model import build_model
    from pipeline.train.config import load_config
    from pipeline.train.memory_estimate import device_lower_bound
    from pipeline.train.parallel import apply_activation_checkpointing

    keys = {**TINY_TRAIN_OVERRIDES, "model.arch": arch, "train.seq_len": 256, "precision.dtype": "fp32"}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**keys, "run_dir": "r", "data.path": "d"}.items()])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    apply_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    bound = device_lower_bound(cfg, world_size=1, value_bytes=4)
    assert bound.state_bytes == 16 * sum(p.numel() for p in model.parameters())
    assert 0 < bound.total <= peak, (bound, peak)


def test_a_run_the_gpu_cannot_hold_is_one_line_before_any_work(
    tmp_path, tiny_data, overrides, monkeypatch, caplog, started
):
    """The issue's 16M-token probe on the paper's widths, on an H200's 141 GiB (the device reading replaced): the
    blocks' inputs alone need 336 GiB. One line naming the keys and the device, exit 2, nothing written; the bound
    is the documented arithmetic: a device with exactly that much passes."""
    from pipeline.train import memory_estimate

    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.Memory(1 << 50, "test"))
    monkeypatch.setattr(memory_estimate, "device_total_bytes", lambda: H200)
    run = tmp_path / "run"
    args = overrides(run, tiny_data, **{**LONG, **PAPER, "data.shuffle_window": 1})
    model_keys = {k.removeprefix("model."): v for k, v in {**TINY_TRAIN_OVERRIDES, **PAPER}.items() if "model." in k}
    with torch.device("meta"):
        params = sum(p.numel() for p in GCAForCausalLM(GCAConfig(**{**model_keys, "groups": [6]})).parameters())
    blocks = 6 + 6 + 2  # n_lower_layers + sum(groups) + n_encoder_layers
    need = 16 * params + blocks * 16777216 * 768 * 2
    with caplog.at_level(logging.ERROR):
        assert trainer.main(None, args) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    for fragment in ("train.seq_len=16777216", "train.micro_batch=1", "cuda:0 (NVIDIA H200) has 141.0 GiB"):
        assert fragment in line, line
    assert f"{host_memory.gib(need)} of GPU memory per rank" in line, line
    assert not run.exists()
    monkeypatch.setattr(memory_estimate, "device_total_bytes", lambda: (need - 1, "cuda:0"))
    assert trainer.main(None, args) == 2
    monkeypatch.setattr(memory_estimate, "device_total_bytes", lambda: (need, "cuda:0"))
    with pytest.raises(Started):
        trainer.main(None, args)

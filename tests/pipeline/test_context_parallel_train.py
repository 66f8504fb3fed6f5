"""Context parallelism in the trainer: FSDP2 runs that split every sequence over a CP group train exactly like one
process on the whole global batch, and their checkpoints resume at another CP degree.

Every run is the trainer launched as users launch it (torchrun, gloo on 127.0.0.1) on the tiny dataset, 3 optimizer
steps of 4 sequences of 64 tokens (8 chunks, 4 per CP rank), under a hard timeout that kills the whole launch. The
references are single-process FSDP runs (cp=1); each CP run must log the same loss at every step (the loss over
whole sequences, 1e-5 relative) and end with the same weights (fp32 tolerance).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port, run_process_group
from safetensors.torch import load_file

from pipeline.train.config import ConfigError, load_config
from pipeline.train.dist import DistInfo
from pipeline.train.trainer import Trainer

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [str(REPO / "launch/pretrain.py"), "--config", str(REPO / "configs/train/debug.yaml")]
STEPS = 3
TIMEOUT_S = 240
BASE = {
    "train.max_steps": STEPS,
    "train.eval_every": 0,
    "parallel.engine": "fsdp",
    "checkpoint.every": 2,
    "checkpoint.export": False,
}
GUMBEL = {**BASE, "model.gumbel_topk": True}
# With dp=2 the two data-parallel ranks draw two Gumbel streams where one process draws one: parity needs clean top-k.
PLAIN = {**BASE, "model.gumbel_topk": False, "train.eval_every": STEPS}  # validation: whole sequences per rank
LOSS_RTOL = 1e-5
STEP2 = "checkpoints/step_00000002"


def launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """torchrun with ``nproc`` ranks; past ``TIMEOUT_S`` the launcher and every rank are killed (a failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPE_COLLECTIVE_TIMEOUT_S": "120"}
    env.pop("PIPE_FAULT", None)
    return run_process_group(cmd + LAUNCH + args, env, REPO, TIMEOUT_S)


def train(run: Path, nproc: int, overrides: list[str]) -> Path:
    proc = launch(nproc, overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


def max_rel_diff(got: dict[int, dict], want: dict[int, dict], key: str) -> float:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    return max(abs(got[s][key] - want[s][key]) / abs(want[s][key]) for s in want)


def val_losses(run: Path) -> list[float]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["val_loss"] for e in events if e.get("event") == "eval"]


def assert_same_weights(got: Path, want: Path) -> float:
    """The final exports hold the same weights (fp32 tolerance); returns the largest absolute difference."""
    w_got, w_want = load_file(got / "export/model.safetensors"), load_file(want / "export/model.safetensors")
    assert w_got.keys() == w_want.keys()
    for name in w_want:
        torch.testing.assert_close(w_got[name], w_want[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return max(float((w_got[n] - w_want[n]).abs().max()) for n in w_want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data, overrides) -> dict[str, Path]:
    """The references (one process, cp=1) and the CP runs, launched once for every test of this module."""
    root = tmp_path_factory.mktemp("cp_train")

    def run(name: str, nproc: int, layer: dict, **extra: object) -> Path:
        return train(root / name, nproc, overrides(root / name, tiny_data, **layer, **extra))

    out = {
        "ref_gumbel": run("ref_gumbel", 1, GUMBEL),
        "ref_plain": run("ref_plain", 1, PLAIN),
        "cp2_gumbel": run("cp2_gumbel", 2, GUMBEL, **{"parallel.context_parallel": 2}),
        "dp2_cp2": run("dp2_cp2", 4, PLAIN, **{"parallel.context_parallel": 2}),
        # Recomputed blocks run their halo exchanges again inside the backward pass, between FSDP's reductions.
        "cp2_recompute": run(
            "cp2_recompute", 2, GUMBEL, **{"parallel.context_parallel": 2, "parallel.activation_checkpointing": True}
        ),
    }
    # Resume the step-2 checkpoint of a cp=2 run with cp=1 on one rank, and a cp=1 one with cp=2 on two ranks.
    out["cp2_to_cp1"] = run("cp2_to_cp1", 1, GUMBEL, **{"checkpoint.resume": out["cp2_gumbel"] / STEP2})
    out["cp1_to_cp2"] = run(
        "cp1_to_cp2",
        2,
        GUMBEL,
        **{"checkpoint.resume": out["ref_gumbel"] / STEP2, "parallel.context_parallel": 2},
    )
    return out


@pytest.mark.parametrize(
    "run, reference",
    [("cp2_gumbel", "ref_gumbel"), ("dp2_cp2", "ref_plain"), ("cp2_recompute", "ref_gumbel")],
    ids=["world2-cp2-gumbel", "world4-dp2-cp2-validation", "world2-cp2-activation-checkpointing"],
)
def test_context_parallel_run_matches_one_process(runs, metrics, run, reference):
    got, want = metrics(runs[run]), metrics(runs[reference])
    rel = max_rel_diff(got, want, "loss")
    assert rel <= LOSS_RTOL, rel
    # AdamW hardly sees a gradient off by a constant factor (a wrong CP/DP scaling); the logged norm does.
    rel = max_rel_diff(got, want, "grad_norm")
    assert rel <= 1e-4, rel
    assert val_losses(runs[run]) == pytest.approx(val_losses(runs[reference]), rel=LOSS_RTOL)
    assert_same_weights(runs[run], runs[reference])


@pytest.mark.parametrize(
    "run, reference",
    [("cp2_to_cp1", "ref_gumbel"), ("cp1_to_cp2", "ref_gumbel")],
    ids=["saved-cp2-resumed-cp1", "saved-cp1-resumed-cp2"],
)
def test_checkpoint_resumes_at_another_context_parallel_degree(runs, metrics, run, reference):
    got, want = metrics(runs[run]), metrics(runs[reference])
    assert sorted(got) == [STEPS]  # resumed after step 2: only step 3 was trained here
    assert got[STEPS]["loss"] == pytest.approx(want[STEPS]["loss"], rel=LOSS_RTOL)
    assert_same_weights(runs[run], runs[reference])


@pytest.mark.parametrize(
    "world, extra, message",
    [
        (3, {"parallel.context_parallel": 2}, "parallel.context_parallel=2 must divide the world size 3"),
        (2, {"parallel.context_parallel": 0}, "parallel.context_parallel must be >= 1; got 0"),
        (
            2,
            {"parallel.context_parallel": 2, "parallel.engine": "deepspeed"},
            "parallel.context_parallel=2 > 1 needs parallel.engine=fsdp; got deepspeed",
        ),
        (
            2,
            {"parallel.context_parallel": 2, "parallel.engine": "none"},
            "parallel.context_parallel=2 > 1 needs parallel.engine=fsdp; got none",
        ),
        (
            2,
            {"parallel.context_parallel": 2, "parallel.engine": "fsdp", "model.arch": "swa"},
            "parallel.context_parallel=2 > 1 needs model.arch=gca; got swa",
        ),
        # 16 tokens of 8-token chunks: one chunk per rank, 9 stream positions < model.window=16.
        (
            2,
            {"parallel.context_parallel": 2, "parallel.engine": "fsdp", "train.seq_len": 16},
            "train.seq_len=16 is too short for parallel.context_parallel=2",
        ),
        # dp = 4 / 2 = 2 data-parallel ranks of 2 sequences: a global batch of 6 does not split.
        (
            4,
            {"parallel.context_parallel": 2, "parallel.engine": "fsdp", "train.global_batch": 6},
            "train.global_batch=6 must be divisible by train.micro_batch x data-parallel ranks (world size / "
            "parallel.context_parallel) = 2 x 2 = 4",
        ),
        # Validation is not split: 2 sequences train on dp = 2 ranks of 1, but do not share out over 4 ranks.
        (
            4,
            {
                "parallel.context_parallel": 2,
                "parallel.engine": "fsdp",
                "train.global_batch": 2,
                "train.micro_batch": 1,
                "train.eval_every": 2,
            },
            "train.global_batch=2 must be divisible by the world size 4 when train.eval_every > 0",
        ),
    ],
    ids=[
        "not-dividing-world",
        "zero",
        "deepspeed",
        "none",
        "baseline-arch",
        "span-shorter-than-window",
        "batch",
        "validation-batch",
    ],
)
def test_config_errors(tmp_path, tiny_data, overrides, world, extra, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(None, overrides(tmp_path / "run", tiny_data, **extra), world)


def test_trainer_checks_the_world_size_of_its_process_group(tmp_path, tiny_data, overrides):
    """A ``Trainer`` built with a config loaded for another world size still refuses a CP degree that does not
    divide the world of its process group, before any work."""
    cfg = load_config(None, overrides(tmp_path / "run", tiny_data, **PLAIN, **{"parallel.context_parallel": 2}), 2)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="^parallel.context_parallel=2 must divide the world size 1"):
        Trainer(cfg, info)
    assert not (tmp_path / "run").exists()


def test_data_parallel_degree_sets_the_accumulation(tmp_path, tiny_data, overrides):
    cfg = load_config(None, overrides(tmp_path / "run", tiny_data, **PLAIN, **{"parallel.context_parallel": 2}), 4)
    assert (cfg.data_parallel(4), cfg.grad_accum(4)) == (2, 1)  # 4 sequences: 2 per dp rank, micro batch 2

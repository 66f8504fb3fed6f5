"""T14 (NaN on one rank; Inf gradient under DeepSpeed), T18 (crafted DeepSpeed checkpoint file), T21 (OOM on one
rank), T22 (a hung rank): two ranks, each launch under a hard timeout. Every failure must end *every* rank with a
clear error in bounded time and leave the last checkpoint intact and verifiable."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from reliability_harness import committed, overrides, train_ranks

from pipeline.train import dist
from pipeline.train.checkpoint import verify_integrity, write_integrity

pytestmark = [pytest.mark.reliability, pytest.mark.dist]

ONE_RANK = dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
DEEPSPEED = {"parallel.engine": "deepspeed", "parallel.zero_stage": 2}


def _exit_codes(output: str) -> list[int]:
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]


def test_t14_nan_on_one_rank_stops_every_rank_before_the_update(data, tmp_path):
    run = tmp_path / "run"
    result = train_ranks(2, overrides(run, data), fault="nan_loss:step=5:rank=1", timeout=120)
    assert result.returncode != 0
    assert result.output.count("non-finite loss or gradient norm at step 5 on rank(s) [1]") >= 2, (
        f"both ranks raise, naming the step and the offending rank:\n{result.output[-4000:]}"
    )
    assert committed(run) == ["step_00000004"]
    verify_integrity(run / "checkpoints/step_00000004", ONE_RANK)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_t14_inf_gradient_under_deepspeed_then_t18_crafted_deepspeed_file(data, tmp_path):
    """An Inf gradient with a finite loss: DeepSpeed computes the norm inside its step, so the trainer checks right
    after it and stops before anything of the step is saved. Then a crafted optimizer-state file, resealed in the
    integrity manifest, is refused before DeepSpeed's own torch.load(weights_only=False) can see it."""
    run = tmp_path / "run"
    args = overrides(run, data, **DEEPSPEED, **{"checkpoint.every": 2})
    result = train_ranks(2, args, fault="inf_grad:step=3", timeout=240)
    assert result.returncode != 0
    assert "non-finite gradient norm at step 3" in result.output, result.output[-6000:]
    assert "found by DeepSpeed inside its optimizer step" in result.output
    assert committed(run) == ["step_00000002"]
    ckpt = run / "checkpoints/step_00000002"
    verify_integrity(ckpt, ONE_RANK)

    marker = tmp_path / "MARKER"
    target = ckpt / "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Payload(marker)}, target)
    write_integrity(ckpt, ONE_RANK)
    again = train_ranks(2, args, timeout=240)
    assert again.returncode != 0
    assert re.search(
        r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: refusing to load: .*GLOBAL posix\.system", again.output
    ), again.output[-3000:]
    assert not marker.exists()


def test_t21_out_of_memory_on_one_rank_ends_every_rank(data, tmp_path):
    run = tmp_path / "run"
    result = train_ranks(2, overrides(run, data, **{"checkpoint.every": 2}), fault="oom:step=3:rank=0", timeout=120)
    assert result.returncode != 0
    assert "rank 0: out of memory at step 3 with train.micro_batch=2; lower train.micro_batch" in result.output, (
        result.output[-4000:]
    )
    assert all(code != 0 for code in _exit_codes(result.output))
    assert committed(run) == ["step_00000002"], "no checkpoint from a half-updated state"
    verify_integrity(run / "checkpoints/step_00000002", ONE_RANK)


def test_t22_a_hung_rank_ends_every_rank_within_a_bound(data, tmp_path):
    """Rank 1 sleeps 120 s inside step 6; collectives time out after 15 s. Rank 0 fails its collective with an
    error naming the step and phase; rank 1's watchdog ends it (stack dump) at 1.5x the timeout. Both exit
    non-zero long before the sleep ends, and the step-4 checkpoint verifies."""
    run = tmp_path / "run"
    result = train_ranks(
        2, overrides(run, data), fault="hang:step=6:rank=1:secs=120", timeout=150, env={dist.TIMEOUT_ENV: "15"}
    )
    assert result.returncode != 0
    assert result.wall_s < 90, f"took {result.wall_s:.0f} s"
    assert re.search(
        r"rank 0: step 6, during forward/backward .* failed: a peer rank died or did not answer within "
        r"15 s",
        result.output,
    ), result.output[-4000:]
    assert "rank 1: step 6 did not finish within 22 s" in result.output or -9 in _exit_codes(result.output)
    assert committed(run) == ["step_00000004"]
    verify_integrity(run / "checkpoints/step_00000004", ONE_RANK)

"""Launcher variables that contradict each other are one line within seconds, exit 2, instead of a silent wait in
the rendezvous (issue 62, finding 2); a genuine rendezvous whose peers do not come says so while it waits and gives
up after the start-up budget."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port, run_process_group

from pipeline.train.launch_env import LaunchEnvError, check

REPO = Path(__file__).resolve().parents[2]

TORCHRUN_RANK_1 = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}
DEEPSPEED_RANK_3 = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_SIZE": "2",
    "CROSS_RANK": "1",
    "CROSS_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SLURM_SCRIPT_RANK_1 = {  # launch/slurm/pretrain.sbatch: srun, one task per node, each a torchrun of one rank
    **TORCHRUN_RANK_1,
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_RESTART_COUNT": "1",
}
ONE_RANK_GROUP = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40000", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
"""What ``dist.init_distributed`` writes for the one-rank group of a plain FSDP or DeepSpeed run."""


@pytest.mark.parametrize(
    "env",
    [{}, TORCHRUN_RANK_1, DEEPSPEED_RANK_3, SLURM_SCRIPT_RANK_1, ONE_RANK_GROUP, {"SLURM_PROCID": "0"}],
    ids=["plain", "torchrun", "deepspeed", "slurm-script", "one-rank-group", "sbatch-step"],
)
def test_every_launcher_of_the_repository_passes(env):
    check(env)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set: torchrun and the deepspeed launcher set both"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 and RANK=0 but MASTER_ADDR and MASTER_PORT are not set"),
        ({"MASTER_ADDR": "node0"}, "MASTER_ADDR=node0 but MASTER_PORT is not set"),
        ({**TORCHRUN_RANK_1, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be an integer >= 1"),
        ({**TORCHRUN_RANK_1, "RANK": "-1"}, "RANK='-1' must be an integer >= 0"),
        ({**TORCHRUN_RANK_1, "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be an integer >= 1"),
        ({**TORCHRUN_RANK_1, "MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be a port, 1-65535"),
        ({**TORCHRUN_RANK_1, "RANK": "2"}, "RANK=2 but WORLD_SIZE=2: RANK runs from 0 to WORLD_SIZE - 1"),
        ({"RANK": "1"}, "RANK=1 but WORLD_SIZE is not set (one process)"),
        ({**TORCHRUN_RANK_1, "LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 but LOCAL_WORLD_SIZE=1"),
        (
            {**DEEPSPEED_RANK_3, "LOCAL_RANK": "2"},
            "LOCAL_RANK=2 but LOCAL_SIZE=2: LOCAL_RANK runs from 0 to LOCAL_SIZE",
        ),
        ({**TORCHRUN_RANK_1, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "LOCAL_WORLD_SIZE=4 ranks on this node"),
        ({"SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT='x' must be an integer >= 0; SLURM when it requeues"),
        (
            {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"},
            "srun started SLURM_STEP_NUM_TASKS=4 copies of this command but WORLD_SIZE is not set",
        ),
        (
            {**SLURM_SCRIPT_RANK_1, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"},
            "torchrun counts GROUP_WORLD_SIZE=1 node(s) but srun started SLURM_STEP_NUM_TASKS=2 tasks",
        ),
        (
            {**ONE_RANK_GROUP, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"},
            "WORLD_SIZE=1 but srun started SLURM_STEP_NUM_TASKS=2 processes of one rank each",
        ),
    ],
)
def test_a_contradiction_is_one_line_naming_the_variables(env, said):
    with pytest.raises(LaunchEnvError) as refused:
        check(env)
    message = str(refused.value)
    assert said in message and "\n" not in message, message


def _launch(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """One ``python launch/pretrain.py`` process with ``env`` on top of a clean launcher environment; returns its exit
    code, its stderr and its wall time (killed past ``timeout``: a failure)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    proc = run_process_group(
        [sys.executable, "launch/pretrain.py", "--config", "configs/train/debug.yaml", *args],
        {**clean, "OMP_NUM_THREADS": "1", **env},
        REPO,
        timeout,
    )
    return proc.returncode, proc.stderr, time.monotonic() - started


def test_a_plain_run_with_a_stray_world_size_stops_at_once(tmp_path, tiny_data, overrides):
    """The issue's case: ``WORLD_SIZE=2`` left in the environment of a one-process run waited in the rendezvous
    until it was killed."""
    code, err, seconds = _launch(overrides(tmp_path / "run", tiny_data), {"WORLD_SIZE": "2"}, timeout=90)
    errors = [line for line in err.splitlines() if "[ERROR]" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "WORLD_SIZE=2 but RANK is not set" in errors[0] and "(unset it)" in errors[0]
    assert seconds < 30 and not (tmp_path / "run").exists()


def test_a_rendezvous_without_its_peers_says_it_waits_and_gives_up_after_the_startup_budget(
    tmp_path, tiny_data, overrides
):
    """Rank 0 of two, a consistent environment, rank 1 never started: rank 0 hosts the rendezvous and waits."""
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["PIPE_STARTUP_TIMEOUT_S"] = "6"
    code, err, seconds = _launch(overrides(tmp_path / "run", tiny_data), env, timeout=90)
    waiting = re.findall(
        rf"rank 0: waiting for the other ranks at 127\.0\.0\.1:{port} \(world size 2\) for \d+ s; "
        r"giving up after 6 s \(PIPE_STARTUP_TIMEOUT_S\)",
        err,
    )
    errors = [line for line in err.splitlines() if "[ERROR]" in line]
    assert code == 1 and len(waiting) >= 1 and len(errors) == 1, err[-3000:]
    assert f"rank 0: the 2 ranks did not all meet at 127.0.0.1:{port} within 6 s (PIPE_STARTUP_TIMEOUT_S)" in errors[0]
    assert seconds < 6 + 30, f"took {seconds:.0f} s"

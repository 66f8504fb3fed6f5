"""``launch/slurm/pretrain.sbatch`` on a real two-node SLURM cluster (``make test-multinode``; nodes ``gca-n0`` and
``gca-n1``, one CPU and one CPU rank each, two slurmd on this machine: see slurm_cluster.py).

1. ``sbatch -N 2``: the two nodes rendezvous at ``MASTER_ADDR=gca-n0`` and train together.
2. Preemption: the same job gets the time-limit signal mid-run; both nodes' ranks checkpoint and exit 75, the job
   requeues itself and resumes to the same per-step losses, to the bit, as the job nobody interrupted.
3. Node loss: every process of node gca-n1's job step (its slurmstepd and all below it, found by the node's mount
   namespace) is SIGKILLed mid-run. Its slurmd is spared: SLURM keeps the node up, so nothing but the job's own
   ranks and srun can notice that the step is gone, which is the case that used to hang. The job must fail within
   a bounded time, and every checkpoint it committed before must be complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from slurm_cluster import wait_for
from slurm_jobs import (
    follow_requeue,
    job_log,
    losses,
    model_overrides,
    prep_settings,
    submit_pretrain,
    wait_while_running,
    write_corpus,
)

from data_prep.config import load_config
from data_prep.shard import main as prep_main

pytestmark = [pytest.mark.multinode]

STEPS = 150
JOB_TIMEOUT_S = 300
# Node loss: a rank whose peer vanished fails its next collective at once (the connection closes) or at the latest
# after this timeout; its node's task ends after node_torchrun's HOST_LINGER_S (15 s, on the rendezvous host
# gca-n0); srun ends the lost node's task NODE_EXIT_WAIT s later, which takes up to KillWait (30 s) + 2 s more
# because that task never reports. The bound adds a margin for a loaded machine.
COLLECTIVE_TIMEOUT_S = 60
NODE_EXIT_WAIT_S = 20
NODE_LOSS_BOUND_S = COLLECTIVE_TIMEOUT_S + 15 + NODE_EXIT_WAIT_S + 32 + 60


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    out = tmp_path_factory.mktemp("prepared") / "data"
    prep_main(load_config(None, [*prep_settings(out, corpus), "tokenizer.vocab_size=320"]))
    return out


def _pretrain(cluster, logs: Path, overrides: list[str], port: int, env: dict[str, str] | None = None) -> int:
    """``sbatch -N 2`` with one CPU rank per node."""
    settings = {"NGPUS_PER_NODE": "1", "MASTER_PORT": str(port), **(env or {})}
    return submit_pretrain(cluster, logs, overrides, settings, ["--nodes=2"])


def _wait_for_step(cluster, job: int, run: Path, logs: Path, step: int, deadline: float) -> None:
    wait_while_running(cluster, job, logs, lambda: len(losses(run)) >= step, deadline, f"step {step}")


@pytest.fixture(scope="module")
def uninterrupted(two_node_cluster, data: Path, free_port, tmp_path_factory: pytest.TempPathFactory):
    """The job nobody interrupts: its log and per-step losses."""
    root = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    job = _pretrain(two_node_cluster, root, model_overrides(root / "run", data, STEPS), free_port())
    fields = two_node_cluster.wait_finished(job, JOB_TIMEOUT_S)
    log = job_log(root, "gca-pretrain", job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        log,
        two_node_cluster.log_tail(),
    )
    print(f"\nuninterrupted job {job}: COMPLETED on {fields['NodeList']}, {time.monotonic() - started:.1f} s")
    return log, losses(root / "run")


def test_two_nodes_rendezvous_and_train(uninterrupted):
    log, got = uninterrupted
    assert "on 2 node(s) [gca-n0 gca-n1], 1 rank(s) and 1 CPU(s) per node, rendezvous gca-n0:" in log, log
    # Under SLURM wandb stays offline unless WANDB_MODE says otherwise (the resolved config, printed by rank 0,
    # which may be on either node: the rendezvous does not order the nodes by their task ids).
    assert re.search(r"^[01]:   wandb_mode: offline$", log, re.MULTILINE), log
    # Each node's task says where it runs (srun --label: task 0 on the first node), for the preflight and the training.
    for task, node in enumerate(("gca-n0", "gca-n1")):
        assert log.count(f"{task}: node_torchrun: starting 1 rank(s) on {node}") == 2, log
    assert "preflight OK: 2 rank(s)" in log and "requeueing" not in log, log
    assert "training ended with exit code 0" in log, log
    assert list(got) == list(range(1, STEPS + 1))


def test_preemption_requeues_and_resumes_exactly(two_node_cluster, data, uninterrupted, free_port, tmp_path):
    cluster, logs, run = two_node_cluster, tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    t0 = time.monotonic()
    timeline = []

    def mark(event: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s  {event}")

    job = _pretrain(cluster, logs, model_overrides(run, data, STEPS), free_port())
    mark(f"submitted job {job}")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    _wait_for_step(cluster, job, run, logs, 5, deadline)
    cluster.cmd("scancel", "--signal=USR1", "--batch", str(job))
    signalled_at = max(losses(run))
    mark(f"SIGUSR1 to the batch script (scancel --signal=USR1 --batch) at step {signalled_at}")
    fields = follow_requeue(cluster, job, deadline, lambda: job_log(logs, "gca-pretrain", job), mark)
    log = job_log(logs, "gca-pretrain", job)
    assert (fields["ExitCode"], fields["Restarts"]) == ("0:0", "1"), log

    first, second = log.split("(restart 1)", 1)
    # Both nodes' tasks ended with the requeue exit code, none was killed by srun or SLURM.
    for task, node in enumerate(("gca-n0", "gca-n1")):
        assert f"srun: error: {node}: task {task}: Exited with exit code 75" in first, first
    saved = int(first.split("stop signal received: saved step ")[1].split(",")[0])
    assert signalled_at <= saved < STEPS, (signalled_at, saved)
    assert f"requeueing job {job} to resume from it" in first
    assert f"resumed from {run}/checkpoints/step_{saved:08d} at step {saved}" in second
    assert "training ended with exit code 0" in second, second
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{saved:08d}", f"step_{STEPS:08d}"]
    mark(f"checkpoint at step {saved}; restart 1 resumed from it on both nodes and finished step {STEPS}")

    expected = uninterrupted[1]
    got = losses(run)
    assert list(got) == list(range(1, STEPS + 1))
    diff = [s for s in got if got[s].hex() != expected[s].hex()]
    assert not diff, f"first differing step {diff[0]}: {got[diff[0]]} vs {expected[diff[0]]}"
    mark(f"final loss {got[STEPS]!r} == uninterrupted {expected[STEPS]!r}; all {STEPS} steps bit-identical")
    print("\n[two nodes, preempted]\n" + "\n".join(timeline))


def _assert_complete(checkpoint: Path) -> None:
    """Every file the save listed in its integrity manifest is there, with its size and sha256, and no other."""
    manifest = json.loads((checkpoint / "integrity.json").read_text())["files"]
    present = {
        str(p.relative_to(checkpoint))
        for p in checkpoint.rglob("*")
        if p.is_file() and p.name not in ("integrity.json", "COMMITTED")
    }
    assert present == set(manifest), (checkpoint, sorted(present ^ set(manifest)))
    for name, want in manifest.items():
        data = (checkpoint / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (want["bytes"], want["sha256"]), checkpoint / name


def test_node_lost_mid_run_fails_the_job_in_bounded_time(two_node_cluster, data, free_port, tmp_path):
    cluster, logs, run = two_node_cluster, tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    # Checkpoints every 20 steps, so that some are committed before the node goes.
    overrides = model_overrides(run, data, 10 * STEPS, checkpoint_every=20)
    env = {"PIPE_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S), "NODE_EXIT_WAIT": str(NODE_EXIT_WAIT_S)}
    job = _pretrain(cluster, logs, overrides, free_port(), env)
    _wait_for_step(cluster, job, run, logs, 45, time.monotonic() + JOB_TIMEOUT_S)

    # The node's processes are those in its slurmd's mount namespace; slurmd itself is spared.
    victims = cluster.node_processes("gca-n1")
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() for pid in victims]
    assert f"slurmstepd: [{job}.1]" in commands, commands  # step 0 is the preflight, step 1 the training
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed_at, killed_step = time.monotonic(), max(losses(run))

    fields = cluster.wait_finished(job, NODE_LOSS_BOUND_S)
    ended_after = time.monotonic() - killed_at
    log = job_log(logs, "gca-pretrain", job)
    assert (fields["JobState"], fields["Restarts"]) == ("FAILED", "0"), (fields, log, cluster.log_tail())
    assert fields["ExitCode"] != "0:0" and "requeueing" not in log, log
    # The surviving node's rank (task 0's) saw its peer go and its task ended (gca-n0 hosts the rendezvous store, so
    # its torchrun does not fail first); srun ended the lost node's task NODE_EXIT_WAIT s later, not at the time
    # limit.
    failure = r"^0: pipeline\.train\.dist\.CollectiveError: rank [01]: .* failed: a peer rank died or did not answer"
    assert re.search(failure, log, re.MULTILINE), log
    assert "srun: error: gca-n0: task 0: Exited with exit code 1" in log, log
    assert f"First task exited {NODE_EXIT_WAIT_S}s ago" in log, log
    wait_for("the job's processes on both nodes to exit", lambda: not cluster.job_processes(), timeout=30)

    committed = sorted(p for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file())
    assert committed and max(losses(run)) < 10 * STEPS, (committed, max(losses(run)))
    for checkpoint in committed:
        _assert_complete(checkpoint)
    print(
        f"\n[node loss] gca-n1's {len(victims)} job processes SIGKILLed at step {killed_step}; job {job} "
        f"{fields['JobState']} (ExitCode {fields['ExitCode']}) {ended_after:.1f} s later (bound "
        f"{NODE_LOSS_BOUND_S} s); committed checkpoints complete: {[p.name for p in committed]}; "
        f"nodes now {cluster.node_states()}"
    )

"""What the SLURM tests share about their jobs: a toy corpus, the tiny model's overrides, submitting
``pretrain.sbatch``, reading a run's per-step losses and a job's log, and following a requeued job to its end."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from helpers import train_overrides
from slurm_cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
_WORDS = (
    "the river ran past old mills and quiet farms while a train crossed the valley at dawn theorem proof "
    "lemma integral derivative matrix vector compute return value function class"
).split()


def write_corpus(root: Path) -> Path:
    """Six jsonl files of 25 documents each."""
    rng = random.Random(0)
    for f in range(6):
        docs = (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(50, 400))) for _ in range(25))
        (root / f"part{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return root


def prep_settings(output: Path, corpus: Path) -> list[str]:
    return [f"output={output}", f"input={corpus}", "val_fraction=0.1", "progress=false", "shard_size_bytes=16384"]


def model_overrides(run_dir: Path, data: Path, steps: int, checkpoint_every: int = 0) -> list[str]:
    """The tests' tiny model (`helpers.TINY_TRAIN_OVERRIDES`, tens of ms per step on 2 CPU ranks) sized to the jobs'
    prepared data; checkpoints every ``checkpoint_every`` steps (0: only at the end or on a stop signal)."""
    job = {
        "model.vocab_size": 320,
        "model.chunk_size": 16,
        "model.window": 32,
        "train.seq_len": 256,
        "train.max_steps": steps,
        "train.eval_every": 0,
        "checkpoint.every": checkpoint_every,
        "checkpoint.export": False,
    }
    return train_overrides(run_dir, data, job)


def wait_while_running(
    cluster: Cluster, job: int, logs: Path, until: Callable[[], bool], deadline: float, what: str
) -> None:
    """Poll until ``until()``; fails with the job's log and the daemons' logs if the job leaves PENDING/RUNNING
    first or ``deadline`` (monotonic) passes."""
    while not until():
        state = cluster.job(job)["JobState"]
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), (
            f"job {job} {state} before {what}",
            job_log(logs, "gca-pretrain", job),
            cluster.log_tail(),
        )
        time.sleep(0.2)


def submit_pretrain(
    cluster: Cluster, logs: Path, overrides: list[str], env: dict[str, str], options: list[str] = ()
) -> int:
    """``pretrain.sbatch`` on CPU ranks with the job's log in ``logs``; ``env`` adds to (or replaces) the settings."""
    settings = {
        "CONFIG": str(REPO / "configs/train/debug.yaml"),
        "CPU_ONLY": "1",
        "GCA_PYTHON": str(REPO / ".venv/bin/python"),
        "RESIGNAL_EVERY": "3",
        **env,
    }
    return cluster.sbatch(
        REPO / "launch/slurm/pretrain.sbatch", overrides, settings, [f"--output={logs}/slurm-%x-%j.out", *options]
    )


def losses(run_dir: Path) -> dict[int, float]:
    found: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written while we read
            break
        if "step" in record and "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def job_log(logs: Path, name: str, job_id: int) -> str:
    path = logs / f"slurm-{name}-{job_id}.out"
    return path.read_text() if path.is_file() else ""


def follow_requeue(
    cluster: Cluster, job: int, deadline: float, describe: Callable[[], str], mark: Callable[[str], None]
) -> dict[str, str]:
    """Wait until ``job`` completes after its requeue, marking each state change; fails on any other end state
    (``describe()`` explains) or past ``deadline`` (monotonic). Returns the final ``scontrol show job`` fields."""
    state, nudged = "RUNNING", False
    while True:
        fields = cluster.job(job)
        assert time.monotonic() < deadline and fields["JobState"] not in ("FAILED", "CANCELLED", "TIMEOUT"), (
            fields,
            describe(),
            cluster.log_tail(),
        )
        if fields["JobState"] != state:
            state = fields["JobState"]
            mark(f"job {job}: {state} (Restarts={fields['Restarts']}, EligibleTime={fields['EligibleTime']})")
        if state == "COMPLETED":
            return fields
        if fields["Reason"] == "BeginTime" and not nudged and not cluster.job_processes():
            # slurmctld holds a requeued job for ~2 min. An administrator's nudge spares the test that wait, once
            # every process of the old run is gone and a second has passed: slurmd refuses ("already killed") a
            # launch whose credential dates from the second in which it revoked the old run's.
            time.sleep(2)
            cluster.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
            nudged = True
            mark(f"job {job}: scontrol update StartTime=now (skips SLURM's requeue delay)")
        time.sleep(0.2)

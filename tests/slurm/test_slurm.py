"""``launch/slurm/*.sbatch`` on a real one-node SLURM cluster (``make test-slurm``; the cluster: slurm_cluster.py).

1. Preemption: ``pretrain.sbatch`` (2 CPU ranks, gloo) gets the time-limit signal (``scancel --signal=USR1
   --batch``: what ``#SBATCH --signal=B:USR1@N`` sends) mid-run, or during its preflight; the ranks checkpoint, the
   job requeues itself, resumes from that checkpoint and produces the same per-step losses, to the bit, as a job
   that was never interrupted.
2. ``prep.sbatch``: tokenizer job -> 3-task array -> dependent merge; the merged dataset reads back every token
   of a single prep run with the same tokenizer.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
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
from data_prep.format import read_manifest
from data_prep.shard import main as prep_main
from data_prep.streaming_compat import ensure_streaming_importable

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
STEPS = 300
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _pretrain(cluster, logs: Path, run_dir: Path, data: Path, port: int) -> int:
    return submit_pretrain(
        cluster, logs, model_overrides(run_dir, data, STEPS), {"NGPUS_PER_NODE": "2", "MASTER_PORT": str(port)}
    )


@pytest.fixture(scope="module")
def data(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    prep_main(load_config(None, [*prep_settings(out, corpus), "tokenizer.vocab_size=320"]))
    return out


@pytest.fixture(scope="module")
def uninterrupted(cluster, data: Path, free_port, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of the job nobody interrupts (exit 0, no requeue)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    job = _pretrain(cluster, root, root / "run", data, free_port())
    fields = cluster.wait_finished(job, JOB_TIMEOUT_S)
    log = job_log(root, "gca-pretrain", job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), log
    assert "preflight OK: 2 rank(s)" in log and "requeueing" not in log
    print(f"\nuninterrupted job {job}: COMPLETED, {STEPS} steps, {time.monotonic() - started:.1f} s")
    return losses(root / "run")


@pytest.mark.parametrize("when", ["mid-run", "at-startup"])
def test_preemption_checkpoints_requeues_and_resumes_exactly(cluster, data, uninterrupted, free_port, tmp_path, when):
    """``mid-run``: the signal comes at step >= 5. ``at-startup``: during the preflight, before any rank has its
    handler, so the batch script must hold it back and repeat it until the ranks act on it."""
    logs, run = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    t0 = time.monotonic()
    timeline = []

    def mark(event: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s  {event}")

    job = _pretrain(cluster, logs, run, data, free_port())
    mark(f"submitted job {job}")
    deadline = time.monotonic() + JOB_TIMEOUT_S

    def started() -> bool:
        if when == "at-startup":
            return "pretrain.sbatch: job" in job_log(logs, "gca-pretrain", job)
        return len(losses(run)) >= 5

    wait_while_running(cluster, job, logs, started, deadline, "the signal")
    cluster.cmd("scancel", "--signal=USR1", "--batch", str(job))
    signalled_at = max(losses(run), default=0)
    mark(f"SIGUSR1 to the batch script (scancel --signal=USR1 --batch) at step {signalled_at}")
    fields = follow_requeue(cluster, job, deadline, lambda: job_log(logs, "gca-pretrain", job), mark)
    log = job_log(logs, "gca-pretrain", job)
    assert (fields["ExitCode"], fields["Restarts"]) == ("0:0", "1"), log

    first, second = log.split("(restart 1)", 1)
    saved = int(first.split("stop signal received: saved step ")[1].split(",")[0])
    assert signalled_at <= saved < STEPS, (signalled_at, saved)
    assert f"requeueing job {job} to resume from it" in first
    assert f"resumed from {run}/checkpoints/step_{saved:08d} at step {saved}" in second
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{saved:08d}", f"step_{STEPS:08d}"]
    mark(f"checkpoint at step {saved}; restart 1 resumed from it and finished step {STEPS}")

    got = losses(run)
    assert list(got) == list(range(1, STEPS + 1))
    diff = [s for s in got if got[s].hex() != uninterrupted[s].hex()]
    assert not diff, f"first differing step {diff[0]}: {got[diff[0]]} vs {uninterrupted[diff[0]]}"
    mark(f"final loss {got[STEPS]!r} == uninterrupted {uninterrupted[STEPS]!r}; all {STEPS} steps bit-identical")
    print(f"\n[{when}]\n" + "\n".join(timeline))


def test_prep_array_job_merges_one_dataset(cluster, corpus, tmp_path):
    out, logs = tmp_path / "merged", tmp_path / "logs"
    logs.mkdir()
    config = tmp_path / "prep.yaml"
    config.write_text("".join(f"{s.replace('=', ': ', 1)}\n" for s in prep_settings(out, corpus)))
    env = {"CONFIG": str(config), "NUM_SLICES": "3", "GCA_PYTHON": str(REPO / ".venv/bin/python"), "LOG_DIR": str(logs)}
    started = time.monotonic()
    head = cluster.sbatch(
        REPO / "launch/slurm/prep.sbatch",
        ["tokenizer.vocab_size=320"],
        env,
        ["--cpus-per-task=1", f"--output={logs}/slurm-%x-%j.out"],
    )
    fields = cluster.wait_finished(head, JOB_TIMEOUT_S)
    head_log = job_log(logs, "gca-prep", head)
    assert fields["JobState"] == "COMPLETED", head_log
    array, merge = map(int, re.search(r"array job (\d+) \(3 tasks\) and the merge as job (\d+)", head_log).groups())
    fields = cluster.wait_finished(merge, JOB_TIMEOUT_S)
    assert fields["JobState"] == "COMPLETED", job_log(logs, "gca-prep-merge", merge)
    for task in range(3):
        assert cluster.job(f"{array}_{task}")["JobState"] == "COMPLETED"
    elapsed = time.monotonic() - started
    manifest = read_manifest(out)
    assert manifest.config["num_slices"] == 3 and manifest.tokenizer.trained
    assert not out.with_name("merged.slices").exists()

    single = tmp_path / "single"
    prep_main(load_config(None, [*prep_settings(single, corpus), f"tokenizer.model={out / 'tokenizer.model'}"]))
    ensure_streaming_importable()
    from streaming import StreamingDataset

    for split in ("train", "val"):
        tokens = []
        for root in (out, single):
            ds = StreamingDataset(
                remote=str(root / split),
                local=str(tmp_path / "cache" / root.name / split),
                shuffle=False,
                batch_size=1,
                validate_hash="xxh64",
            )
            tokens.append([t for i in range(len(ds)) for t in ds[i]["tokens"].tolist()])
        assert len(tokens[0]) == manifest.splits[split].tokens > 0
        assert tokens[0] == tokens[1], split
    print(
        f"\nprep: tokenizer job {head} -> array {array} (3 tasks) -> merge {merge}: {elapsed:.1f} s; "
        f"train {manifest.splits['train'].tokens} + val {manifest.splits['val'].tokens} tokens read back"
    )

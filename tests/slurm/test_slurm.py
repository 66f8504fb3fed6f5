"""``launch/slurm/*.sbatch`` on a real one-node SLURM cluster (``make test-slurm``; the cluster is in conftest.py).

1. Preemption: ``pretrain.sbatch`` (2 CPU ranks, gloo) gets the time-limit signal (``scancel --signal=USR1
   --batch``: what ``#SBATCH --signal=B:USR1@N`` sends) mid-run, or during its preflight; the ranks checkpoint, the
   job requeues itself, resumes from that checkpoint and produces the same per-step losses, to the bit, as a job
   that was never interrupted.
2. ``prep.sbatch``: tokenizer job -> 3-task array -> dependent merge; the merged dataset reads back every token
   of a single prep run with the same tokenizer.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from data_prep.config import load_config
from data_prep.format import read_manifest
from data_prep.shard import main as prep_main
from data_prep.streaming_compat import ensure_streaming_importable

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
STEPS = 300
JOB_TIMEOUT_S = 300
_WORDS = (
    "the river ran past old mills and quiet farms while a train crossed the valley at dawn theorem proof "
    "lemma integral derivative matrix vector compute return value function class"
).split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six jsonl files of 25 documents each."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for f in range(6):
        docs = (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(50, 400))) for _ in range(25))
        (root / f"part{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return root


def _prep_settings(output: Path, corpus: Path) -> list[str]:
    return [f"output={output}", f"input={corpus}", "val_fraction=0.1", "progress=false", "shard_size_bytes=16384"]


def _model_overrides(run_dir: Path, data: Path) -> list[str]:
    """A tiny model (tens of ms per step on 2 CPU ranks), checkpoints only at the end or on a stop signal."""
    values = {
        "run_dir": run_dir,
        "data.path": data,
        "seed": 7,
        "model.vocab_size": 320,
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.n_kv_heads": 2,
        "model.ffn_hidden": 64,
        "model.n_lower_layers": 1,
        "model.groups": "[1]",
        "model.n_encoder_layers": 1,
        "model.chunk_size": 16,
        "model.top_k": 2,
        "model.window": 32,
        "model.attn_backend": "naive",
        "train.seq_len": 256,
        "train.micro_batch": 2,
        "train.global_batch": 4,
        "train.max_steps": STEPS,
        "train.eval_every": 0,
        "optim.lr": 3e-3,
        "optim.min_lr": 3e-4,
        "schedule.warmup_steps": 2,
        "data.shuffle_window": 8,
        "logging.every": 1,
        "logging.progress": False,
        "checkpoint.every": 0,
        "checkpoint.export": False,
    }
    return [f"{k}={v}" for k, v in values.items()]


def _losses(run_dir: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written while we read
            break
        if "step" in record and "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def _log(logs: Path, name: str, job_id: int) -> str:
    path = logs / f"slurm-{name}-{job_id}.out"
    return path.read_text() if path.is_file() else ""


def _pretrain(cluster, logs: Path, run_dir: Path, data: Path, port: int) -> int:
    env = {
        "CONFIG": str(REPO / "configs/train/debug.yaml"),
        "NGPUS_PER_NODE": "2",
        "CPU_ONLY": "1",
        "MASTER_PORT": str(port),
        "GCA_PYTHON": str(REPO / ".venv/bin/python"),
        "RESIGNAL_EVERY": "3",
    }
    return cluster.sbatch(
        REPO / "launch/slurm/pretrain.sbatch",
        _model_overrides(run_dir, data),
        env,
        [f"--output={logs}/slurm-%x-%j.out"],
    )


@pytest.fixture(scope="module")
def data(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    prep_main(load_config(None, [*_prep_settings(out, corpus), "tokenizer.vocab_size=320"]))
    return out


@pytest.fixture(scope="module")
def uninterrupted(cluster, data: Path, free_port, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of the job nobody interrupts (exit 0, no requeue)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    job = _pretrain(cluster, root, root / "run", data, free_port())
    fields = cluster.wait_finished(job, JOB_TIMEOUT_S)
    log = _log(root, "gca-pretrain", job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), log
    assert "preflight OK: 2 rank(s)" in log and "requeueing" not in log
    print(f"\nuninterrupted job {job}: COMPLETED, {STEPS} steps, {time.monotonic() - started:.1f} s")
    return _losses(root / "run")


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
            return "pretrain.sbatch: job" in _log(logs, "gca-pretrain", job)
        return len(_losses(run)) >= 5

    while not started():
        state = cluster.job(job)["JobState"]
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), (
            state,
            _log(logs, "gca-pretrain", job),
            cluster.log_tail(),
        )
        time.sleep(0.2)
    cluster.cmd("scancel", "--signal=USR1", "--batch", str(job))
    signalled_at = max(_losses(run), default=0)
    mark(f"SIGUSR1 to the batch script (scancel --signal=USR1 --batch) at step {signalled_at}")
    state, nudged = "RUNNING", False
    while state != "COMPLETED":
        fields = cluster.job(job)
        assert time.monotonic() < deadline and fields["JobState"] not in ("FAILED", "CANCELLED", "TIMEOUT"), (
            fields,
            _log(logs, "gca-pretrain", job),
            cluster.log_tail(),
        )
        if fields["JobState"] != state:
            state = fields["JobState"]
            mark(f"job {job}: {state} (Restarts={fields['Restarts']}, EligibleTime={fields['EligibleTime']})")
        if fields["Reason"] == "BeginTime" and not nudged and not cluster.job_processes():
            # slurmctld holds a requeued job for ~2 min. An administrator's nudge spares the test that wait, once
            # every process of the old run is gone and a second has passed: slurmd refuses ("already killed") a
            # launch whose credential dates from the second in which it revoked the old run's.
            time.sleep(2)
            cluster.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
            nudged = True
            mark(f"job {job}: scontrol update StartTime=now (skips SLURM's requeue delay)")
        time.sleep(0.2)
    log = _log(logs, "gca-pretrain", job)
    assert (fields["ExitCode"], fields["Restarts"]) == ("0:0", "1"), log

    first, second = log.split("(restart 1)", 1)
    saved = int(first.split("stop signal received: saved step ")[1].split(",")[0])
    assert signalled_at <= saved < STEPS, (signalled_at, saved)
    assert f"requeueing job {job} to resume from it" in first
    assert f"resumed from {run}/checkpoints/step_{saved:08d} at step {saved}" in second
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{saved:08d}", f"step_{STEPS:08d}"]
    mark(f"checkpoint at step {saved}; restart 1 resumed from it and finished step {STEPS}")

    got = _losses(run)
    assert list(got) == list(range(1, STEPS + 1))
    diff = [s for s in got if got[s].hex() != uninterrupted[s].hex()]
    assert not diff, f"first differing step {diff[0]}: {got[diff[0]]} vs {uninterrupted[diff[0]]}"
    mark(f"final loss {got[STEPS]!r} == uninterrupted {uninterrupted[STEPS]!r}; all {STEPS} steps bit-identical")
    print(f"\n[{when}]\n" + "\n".join(timeline))


def test_prep_array_job_merges_one_dataset(cluster, corpus, tmp_path):
    out, logs = tmp_path / "merged", tmp_path / "logs"
    logs.mkdir()
    config = tmp_path / "prep.yaml"
    config.write_text("".join(f"{s.replace('=', ': ', 1)}\n" for s in _prep_settings(out, corpus)))
    env = {"CONFIG": str(config), "NUM_SLICES": "3", "GCA_PYTHON": str(REPO / ".venv/bin/python"), "LOG_DIR": str(logs)}
    started = time.monotonic()
    head = cluster.sbatch(
        REPO / "launch/slurm/prep.sbatch",
        ["tokenizer.vocab_size=320"],
        env,
        ["--cpus-per-task=1", f"--output={logs}/slurm-%x-%j.out"],
    )
    fields = cluster.wait_finished(head, JOB_TIMEOUT_S)
    head_log = _log(logs, "gca-prep", head)
    assert fields["JobState"] == "COMPLETED", head_log
    array, merge = map(int, re.search(r"array job (\d+) \(3 tasks\) and the merge as job (\d+)", head_log).groups())
    fields = cluster.wait_finished(merge, JOB_TIMEOUT_S)
    assert fields["JobState"] == "COMPLETED", _log(logs, "gca-prep-merge", merge)
    for task in range(3):
        assert cluster.job(f"{array}_{task}")["JobState"] == "COMPLETED"
    elapsed = time.monotonic() - started
    manifest = read_manifest(out)
    assert manifest.config["num_slices"] == 3 and manifest.tokenizer.trained
    assert not out.with_name("merged.slices").exists()

    single = tmp_path / "single"
    prep_main(load_config(None, [*_prep_settings(single, corpus), f"tokenizer.model={out / 'tokenizer.model'}"]))
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

"""Two nodes on one machine under ``torchrun --nnodes 2 --rdzv-backend c10d`` (nodes.py: own hostname, address,
pid namespace, /dev/shm and scratch per node; shared data and run directories).

1. Training on 2 nodes x 1 and 2 x 2 ranks, FSDP2 and DeepSpeed ZeRO-2, gives the losses of one node with the
   same world size and global batch; each checkpoint file has exactly one writer (shards by their own rank, the
   metadata by rank 0, a write audit in every process records it), and the directory is renamed once.
2. A checkpoint of 2 nodes x 1 rank resumes on 1 node x 2 ranks with the same losses as the uninterrupted run.
3. A lost node (SIGKILL of every process of that node): the surviving node ends in bounded time with an error
   naming the failed collective; relaunching both nodes resumes from the last committed checkpoint and
   reproduces the uninterrupted losses to the bit.
4. Preflight across nodes names the node whose library versions differ.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from multinode_runs import RUN_TIMEOUT_S, STEPS, assert_losses, last_step, launch, logs, run_args, train
from nodes import Cluster, node_name
from reliability.reliability_harness import committed, read_metrics

pytestmark = pytest.mark.multinode

COLLECTIVE_TIMEOUT_S = 30
"""``PIPE_COLLECTIVE_TIMEOUT_S`` of the node-loss runs: the bound within which a survivor must give up."""
AUDIT = Path(__file__).resolve().parent / "audit"
SHARD_OWNER = re.compile(r"(?:rng_rank|zero_pp_rank_|/__)(\d+)")
"""The rank whose shard a checkpoint file is: ``rng_rank<r>.pt``, DeepSpeed's ``zero_pp_rank_<r>_...``, DCP's
``__<r>_0.distcp``."""


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def checkpoint_writers(audit: Path, run: Path) -> tuple[dict[tuple[str, str], set[tuple[str, str]]], list[str]]:
    """``{(step dir, file in it): {(host, rank) that wrote it}}`` and the renames of whole step directories. A
    file written under a temporary name and renamed inside its step directory (DCP's ``.metadata.tmp``) counts
    under its final name."""
    root = run / "checkpoints"

    def in_step(path: str) -> tuple[str, str] | None:
        if not path.startswith(f"{root}/"):
            return None
        parts = Path(path).relative_to(root).parts
        return (parts[0].removesuffix(".tmp"), str(Path(*parts[1:]))) if len(parts) > 1 else None

    writers: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    dir_renames, file_renames = [], {}
    for path in audit.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "rename":
                src, dst = (in_step(p) for p in record["path"].split(" -> "))
                if src is None:
                    dir_renames.append(record["path"])
                else:
                    file_renames[src] = dst
            elif (key := in_step(record["path"])) is not None:
                writers[key].add((record["host"], record["rank"]))
    for src, dst in file_renames.items():
        writers[dst] |= writers.pop(src)
    return writers, dir_renames


@dataclass
class AuditedRun:
    run: Path
    audit: Path
    dataset_unchanged: bool


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, data, free_port) -> Callable[[str, tuple[int, int]], AuditedRun]:
    """An uninterrupted run of ``layout`` = (2 nodes, ranks per node) with the write audit in every process, made
    once per (engine, layout) and shared by the tests below as their reference."""
    made: dict[tuple[str, tuple[int, int]], AuditedRun] = {}

    def get(engine: str, layout: tuple[int, int]) -> AuditedRun:
        if (engine, layout) not in made:
            root = tmp_path_factory.mktemp(f"two-nodes-{engine}-{layout[1]}")
            run, audit = root / "run", root / "audit"
            audit.mkdir()
            env = {"PYTHONPATH": str(AUDIT), "GCA_AUDIT_ROOT": f"{run}/", "GCA_AUDIT_DIR": str(audit)}
            before = snapshot(data)
            cluster = Cluster(root / "cluster")
            started = time.monotonic()
            try:
                train(cluster, layout, free_port(), run_args(run, data, engine), **env)
            finally:
                cluster.close()
            print(f"\n{engine} {layout[0]}x{layout[1]}: {STEPS} steps in {time.monotonic() - started:.1f} s")
            made[engine, layout] = AuditedRun(run, audit, snapshot(data) == before)
        return made[engine, layout]

    return get


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("layout", [(2, 1), (2, 2)], ids=["2x1", "2x2"])
def test_two_nodes_train_like_one_node_and_write_each_file_once(single_node, two_nodes, engine, layout):
    done = two_nodes(engine, layout)
    run = done.run
    assert_losses(single_node(engine, layout[0] * layout[1]), run, range(1, STEPS + 1), exact=False)
    assert done.dataset_unchanged, "the shared dataset (zstd shards) is read, never unpacked in place"

    assert committed(run) == [f"step_{s:08d}" for s in (4, 8, 12)]
    writers, renames = checkpoint_writers(done.audit, run)
    for step in committed(run):
        files = {name: who for (s, name), who in writers.items() if s == step}
        on_disk = {str(p.relative_to(run / "checkpoints" / step)) for p in (run / "checkpoints" / step).rglob("*")}
        assert set(files) <= on_disk, f"{step}: written but not in the checkpoint: {set(files) - on_disk}"
        many = {name: who for name, who in files.items() if len(who) != 1}
        assert not many, f"{step}: files with several writers: {many}"
        for name, ((host, rank),) in files.items():
            if (owner := SHARD_OWNER.search(name)) is not None:
                assert owner.group(1) == rank, f"{step}/{name} written by rank {rank}"
            elif name in ("trainer_state.json", "integrity.json", "OWNER.json", "COMMITTED"):
                assert rank == "0", f"{step}/{name} written by rank {rank} on {host}"
        hosts = {host for who in files.values() for host, _ in who}
        assert hosts == {node_name(0), node_name(1)}, f"{step}: every node writes its own shards, got {hosts}"
        assert [r for r in renames if f"/{step}.tmp ->" in r] == [
            f"{run}/checkpoints/{step}.tmp -> {run}/checkpoints/{step}"
        ], "the step directory is renamed exactly once"


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_checkpoint_of_two_nodes_resumes_on_one_node(cluster, data, two_nodes, free_port, tmp_path, engine):
    """2 nodes x 1 rank -> 1 node x 2 ranks: the same world size in another node layout resumes exactly."""
    first = two_nodes(engine, (2, 1)).run
    moved = tmp_path / "one_node"
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copytree(first / "checkpoints/step_00000004", moved / "checkpoints/step_00000004")
    train(cluster, (1, 2), free_port(), run_args(moved, data, engine), tag="resume")
    resumed = cluster.running[-1].output()
    assert "step_00000004 at step 4" in resumed, resumed[-3000:]  # the trainer's "resumed from <dir> at step N"
    assert min(read_metrics(moved)) == 5, "the one-node run started from the two-node checkpoint of step 4"
    assert_losses(first, moved, range(5, STEPS + 1), exact=True)


@pytest.mark.parametrize("lost", [1, 0], ids=["worker-node", "rendezvous-node"])
def test_lost_node_fails_the_job_in_bounded_time_and_a_relaunch_resumes_exactly(
    cluster, data, two_nodes, free_port, tmp_path, lost
):
    """Node ``lost`` stalls at step 7 (a fault plan on that node only, so the loss lands after the step-4
    checkpoint and before the step-8 one) and is then killed whole. Node 1 is a plain worker node; node 0 also
    holds global rank 0 and torchrun's rendezvous store."""
    engine = "fsdp"
    reference = two_nodes(engine, (2, 1)).run

    run = tmp_path / "run"
    timeout_env = {"PIPE_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    env = {i: dict(timeout_env) for i in range(2)}
    env[lost]["PIPE_FAULT"] = f"hang:step=7:rank={lost}"
    nodes = launch(cluster, (2, 1), free_port(), run_args(run, data, engine), env, tag="lost")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while last_step(run) < 6:
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), logs(nodes)
        time.sleep(0.2)
    time.sleep(1.0)  # the stalled rank is now asleep in step 7; its peer waits for it in a collective
    nodes[lost].kill()
    killed = time.monotonic()
    survivor = nodes[1 - lost]
    code = survivor.wait(COLLECTIVE_TIMEOUT_S * 2 + 30)
    waited = time.monotonic() - killed
    print(f"\nnode {lost} lost: node {1 - lost} exited {code} after {waited:.1f} s")
    assert code is not None, f"the surviving node still runs {waited:.0f} s after the loss\n{logs(nodes)}"
    assert code != 0, logs(nodes)
    # The surviving rank names the collective and the step. When node 0 holding the rendezvous store is lost,
    # the survivor's torchrun may see the store gone and stop its rank before that rank's own error.
    named = ["failed: a peer rank died or did not answer"]
    if lost == 0:
        named.append("RendezvousConnectionError: The connection to the C10d store has failed")
    assert any(line in survivor.output() for line in named), survivor.output()[-4000:]
    assert committed(run) == ["step_00000004"], "only the checkpoint before the loss is committed"

    train(cluster, (2, 1), free_port(), run_args(run, data, engine), tag="relaunch")
    relaunch_log = cluster.running[-1].output() + cluster.running[-2].output()
    assert "step_00000004" in relaunch_log, relaunch_log[-4000:]
    assert_losses(reference, run, range(1, STEPS + 1), exact=True)


@pytest.mark.parametrize(
    ("script", "exit_code", "verdict"),
    [
        ("launch/preflight.py", 1, "preflight FAILED: 1 problem(s)"),
        ("launch/pretrain.py", 2, "the nodes run different library versions (above); not starting the training"),
    ],
    ids=["preflight", "trainer"],
)
def test_a_node_with_other_library_versions_is_named_before_training(
    cluster, data, free_port, tmp_path, script, exit_code, verdict
):
    """Node 1's Python sees another numpy distribution first on its path: its environment differs. Both the
    preflight and the trainer's own start-up check name that node, and no step runs."""
    other = tmp_path / "other-env"
    dist_info = other / "numpy-0.0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 0.0.1\n")
    run = tmp_path / "run"
    args = run_args(run, data, "fsdp")
    if script == "launch/preflight.py":
        args = ["--gpus-per-node", "0", *args]
    nodes = launch(cluster, (2, 1), free_port(), args, {1: {"PYTHONPATH": str(other)}}, script=script)
    codes = cluster.wait_all(nodes, RUN_TIMEOUT_S)
    report = nodes[0].output()
    assert codes[0] == 1 and f"exitcode  : {exit_code}" in report, logs(nodes)  # torchrun's failure table
    assert f"preflight: {node_name(1)} rank 1: versions: numpy 0.0.1 (rank 0 on {node_name(0)}:" in report, report
    assert verdict in report, report
    assert last_step(run) == 0, "no training step ran"

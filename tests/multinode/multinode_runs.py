"""Training runs of the multinode tier: launcher commands, the tiny model's settings, and loss comparisons."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from nodes import REPO, Cluster, Node, node_name
from reliability.reliability_harness import CONFIG, overrides, read_metrics

STEPS = 12
"""Optimizer steps of every run; checkpoints every 4 steps (the catalogue's harness settings)."""
GLOBAL_BATCH = 8
"""Sequences per optimizer step, whatever the layout (micro batch 2: 4 micro-steps on 2 ranks, 1 on 4 ranks...)."""
ENGINES = {"fsdp": {"parallel.engine": "fsdp"}, "deepspeed": {"parallel.engine": "deepspeed", "parallel.zero_stage": 2}}
RUN_TIMEOUT_S = 300


def torchrun(nnodes: int, nproc: int, port: int, script: str, args: list[str]) -> list[str]:
    """The command every node runs: c10d rendezvous on node 0's name, no restarts (the job fails as a whole)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{node_name(0)}:{port}",
        "--rdzv-id",
        f"job-{port}",
        "--max-restarts",
        "0",
        str(REPO / script),
        "--config",
        CONFIG,
        *args,
    ]


def start_nodes(
    cluster: Cluster, nnodes: int, command: Callable[[int], list[str]], env: dict[int, dict[str, str]], tag: str
) -> list[Node]:
    """Node ``i`` runs ``command(i)`` with its extra environment ``env.get(i)``."""
    return [cluster.start(i, command(i), env.get(i), tag) for i in range(nnodes)]


def launch(
    cluster: Cluster,
    layout: tuple[int, int],
    port: int,
    args: list[str],
    env: dict[int, dict[str, str]] | None = None,
    script: str = "launch/pretrain.py",
    tag: str = "",
) -> list[Node]:
    """``layout`` = (nodes, ranks per node) under torchrun."""
    cmd = torchrun(*layout, port, script, args)
    return start_nodes(cluster, layout[0], lambda _: cmd, env or {}, tag)


def logs(nodes: list[Node]) -> str:
    return "\n".join(f"--- {n.name}:\n{n.output()[-4000:]}" for n in nodes)


def finish(cluster: Cluster, nodes: list[Node]) -> None:
    """Wait for ``nodes``; every one must exit 0."""
    codes = cluster.wait_all(nodes, RUN_TIMEOUT_S)
    assert codes == [0] * len(nodes), logs(nodes)


def train(cluster: Cluster, layout: tuple[int, int], port: int, args: list[str], tag: str = "", **env: str) -> None:
    finish(cluster, launch(cluster, layout, port, args, {i: env for i in range(layout[0])}, tag=tag))


def run_args(run: Path, data: Path, engine: str, **extra: object) -> list[str]:
    settings = {"train.max_steps": STEPS, "train.global_batch": GLOBAL_BATCH, **ENGINES[engine], **extra}
    return overrides(run, data, **settings)


def last_step(run: Path) -> int:
    """The last step the run logged so far (0 before the first; a line being written counts from the next look)."""
    try:
        return max(read_metrics(run), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def assert_losses(reference: Path, run: Path, steps: range, exact: bool) -> None:
    """Per-step losses equal to the bit (``exact``) or within rtol 1e-5 (the parity tests' tolerance), same lr."""
    ref, got = read_metrics(reference), read_metrics(run)
    for step in steps:
        if exact:
            assert got[step]["loss"].hex() == ref[step]["loss"].hex(), f"step {step}"
        else:
            assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), f"step {step}"
        assert got[step]["lr"] == ref[step]["lr"], f"step {step}"

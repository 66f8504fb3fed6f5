"""DeepSpeed's own launcher on two nodes without ssh: each node runs ``deepspeed --no_ssh --node_rank <i>`` with
the same hostfile and the master address of node 0 (the way to start a run on a cluster with neither SLURM nor
ssh between nodes). The losses equal one node's with the same world size and global batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from multinode_runs import STEPS, assert_losses, finish, run_args, start_nodes
from nodes import REPO, node_name
from reliability.reliability_harness import CONFIG

pytestmark = pytest.mark.multinode


def deepspeed_command(hostfile: Path, port: int, args: list[str]) -> Callable[[int], list[str]]:
    def for_node(index: int) -> list[str]:
        return [
            str(REPO / ".venv/bin/deepspeed"),
            "--no_ssh",
            "--node_rank",
            str(index),
            "--hostfile",
            str(hostfile),
            "--master_addr",
            node_name(0),
            "--master_port",
            str(port),
            str(REPO / "launch/pretrain.py"),
            "--config",
            CONFIG,
            *args,
        ]

    return for_node


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_deepspeed_launcher_without_ssh_trains_like_one_node(
    cluster, data, single_node, free_port, tmp_path, ranks_per_node
):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{node_name(i)} slots={ranks_per_node}\n" for i in range(2)))
    run = tmp_path / "run"
    command = deepspeed_command(hostfile, free_port(), run_args(run, data, "deepspeed"))
    nodes = start_nodes(cluster, 2, command, {}, tag="deepspeed")
    finish(cluster, nodes)
    for i, node in enumerate(nodes):
        assert f"nnodes=2, num_local_procs={ranks_per_node}, node_rank={i}" in node.output(), node.output()[-3000:]
    assert_losses(single_node("deepspeed", 2 * ranks_per_node), run, range(1, STEPS + 1), exact=False)

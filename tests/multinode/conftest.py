"""Fixtures of the multinode tier (``make test-multinode``, root needed for the node namespaces; nodes.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from multinode_runs import run_args, train
from nodes import Cluster
from reliability.reliability_harness import write_dataset


@pytest.fixture(scope="session", autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the multinode tests give every simulated node its own namespaces: run make test-multinode as root")


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reliability catalogue's tiny prepared dataset, read by every node (never modified)."""
    return write_dataset(tmp_path_factory.mktemp("multinode") / "data")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two simulated nodes; whatever still runs at the end of the test is killed, pass or fail."""
    nodes = Cluster(tmp_path / "cluster")
    try:
        yield nodes
    finally:
        nodes.close()


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A free TCP port below the ephemeral range, so the kernel cannot hand it to an outgoing connection meanwhile."""

    start = 20000 + os.getpid() % 6000
    taken: set[int] = set()

    def pick() -> int:
        for port in range(start, 32000):
            if port in taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                taken.add(port)
                return port
        raise RuntimeError("no free port in 20000-32000")

    return pick


@pytest.fixture(scope="session")
def single_node(tmp_path_factory, data, free_port) -> Callable[[str, int], Path]:
    """The run directory of a one-node run (same world size and global batch), made once per (engine, ranks)."""
    made: dict[tuple[str, int], Path] = {}

    def get(engine: str, world: int) -> Path:
        if (engine, world) not in made:
            root = tmp_path_factory.mktemp(f"single-{engine}-{world}")
            cluster = Cluster(root / "cluster", nodes=1)
            try:
                train(cluster, (1, world), free_port(), run_args(root / "run", data, engine))
            finally:
                cluster.close()
            made[engine, world] = root / "run"
        return made[engine, world]

    return get

"""Fixtures of the SLURM tests: real clusters of one node (``slurm`` tests) and two nodes (``multinode`` tests),
started and torn down by `slurm_cluster.start_cluster` (see there). Module-scoped, so that two clusters never share the
machine's CPUs when both markers run in one session."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import slurm_cluster
from slurm_cluster import Cluster, start_cluster


def _cluster(nodes: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    try:
        # The daemons' logs outlive the cluster in pytest's own temporary directory, for post-mortems.
        with start_cluster(nodes, keep_logs=tmp_path_factory.mktemp("slurm-daemon-logs")) as cluster:
            yield cluster
    except PermissionError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(1, tmp_path_factory)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(2, tmp_path_factory)


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    return slurm_cluster.free_port

"""Simulated nodes of a cluster on this one machine, for the ``multinode`` tier (``make test-multinode``).

A node is a command started in its own Linux namespaces (``unshare``, needs root):

- **pid**: the node's processes live in their own pid namespace whose init is the node's command; killing the
  ``unshare`` process (``--kill-child``) kills that init, and the kernel then kills every process of the node.
  That is what "the node is lost" means here, and it also guarantees teardown.
- **uts**: its own hostname (``gca-node<i>``), as every real node has one. The launchers and the trainer name nodes
  by hostname (torch's rendezvous orders and addresses nodes by it, private data caches are named after it).
- **mount**: a private tmpfs ``/dev/shm`` (DeepSpeed's CPU all-reduce buffers and streaming's shared-memory state
  are per node on a real cluster and would collide on one host) and an ``/etc/hosts`` that resolves every node's
  name to its own loopback address (``127.0.10.<i+1>``), so all traffic stays on this machine. Distinct names
  and addresses matter: torch's rendezvous tells nodes apart by (fully qualified host name, pid), and with the
  pid namespace every node's launcher is pid 1.

Each node also gets a node-local scratch directory (``TMPDIR``); the run and data directories are shared, as on
a cluster's shared file system.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHM_SIZE = "1g"


def node_name(index: int) -> str:
    return f"gca-node{index}"


def node_address(index: int) -> str:
    """Node ``index``'s own address: one of the loopback block 127.0.0.0/8, so traffic never leaves the machine."""
    return f"127.0.10.{index + 1}"


def write_hosts(path: Path, nodes: int) -> Path:
    lines = ["127.0.0.1 localhost", *(f"{node_address(i)} {node_name(i)}" for i in range(nodes))]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Node:
    """One running node: ``proc`` is the ``unshare`` process; its output goes to ``log``."""

    index: int
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return node_name(self.index)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def kill(self) -> None:
        """Lose the node: SIGKILL its namespace's init, which takes every process of the node with it."""
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float) -> int | None:
        """The node's exit code, or None if it is still running after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return None


class Cluster:
    """Nodes started by one test; ``close`` (always called by the fixture) kills whatever is still running."""

    def __init__(self, root: Path, nodes: int = 2) -> None:
        self.root = root
        self.size = nodes
        root.mkdir(parents=True, exist_ok=True)
        self.hosts = write_hosts(root / "hosts", nodes)
        self.running: list[Node] = []

    def scratch(self, index: int) -> Path:
        """The node-local scratch directory (its ``TMPDIR``)."""
        path = self.root / node_name(index) / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, index: int, cmd: list[str], env: dict[str, str] | None = None, tag: str = "") -> Node:
        """Run ``cmd`` (from the repository root) as node ``index``; ``env`` is added to this process's."""
        name = node_name(index)
        setup = (
            f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm"
            f' && mount --bind "$GCA_NODE_HOSTS" /etc/hosts && hostname {name} && exec "$@"'
        )
        inherited = {k: v for k, v in os.environ.items() if k != "PIPE_FAULT"}  # faults only where a test plans them
        full_env = {
            **inherited,
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "WANDB_MODE": "disabled",
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(self.scratch(index)),
            "GCA_NODE_HOSTS": str(self.hosts),
            **(env or {}),
        }
        log = self.root / f"{name}{'-' + tag if tag else ''}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    "--uts",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    setup,
                    "node",
                    *cmd,
                ],
                cwd=REPO,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = Node(index, proc, log)
        self.running.append(node)
        return node

    def wait_all(self, nodes: list[Node], timeout: float) -> list[int]:
        """Every node's exit code; if one is still running after ``timeout`` s, all are killed and this raises."""
        deadline = time.monotonic() + timeout
        codes = []
        for node in nodes:
            code = node.wait(deadline - time.monotonic())
            if code is None:
                self.close()
                logs = "\n".join(f"--- {n.name}:\n{n.output()[-3000:]}" for n in nodes)
                raise TimeoutError(f"{node.name} still running after {timeout:.0f} s (all nodes killed)\n{logs}")
            codes.append(code)
        return codes

    def close(self) -> None:
        for node in self.running:
            node.kill()
        for node in self.running:
            if node.wait(15) is None:  # unshare ignores nothing, but never hang a teardown
                os.killpg(node.proc.pid, signal.SIGKILL)
        self.running.clear()

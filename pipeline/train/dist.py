"""The distributed environment: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

``init_distributed`` picks the device and backend (NCCL on CUDA, gloo on CPU), creates the process group the
chosen engine needs, and returns a ``DistInfo``. The small collectives below (``all_reduce_*``, ``barrier``,
``*_object``) are no-ops when no process group exists, so single-process runs use the same trainer code.

Hangs are bounded twice. Every collective has a timeout (``PIPE_COLLECTIVE_TIMEOUT_S``, default 600 s): a rank
waiting for a stuck peer raises instead of waiting forever. The stuck rank itself (in a sleep, an I/O wait, a C
call) is ended by ``Watchdog``: when one training step outlasts 1.5x that timeout, it logs which step hung, dumps
every thread's stack and exits with `EXIT_HUNG`, so every rank ends with a clear error in bounded time.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT_ENV = "PIPE_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600
EXIT_HUNG = 124
"""Exit code of a process the watchdog ended (the code ``timeout(1)`` uses)."""
BACKSTOP_GRACE_S = 10.0
"""How long after the watchdog's deadline its C-level backstop (``faulthandler``) ends a process whose GIL is held."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died or hangs); the message names the step and the phase."""


def collective_timeout_s() -> float:
    """Seconds a collective may wait for its peers: ``$PIPE_COLLECTIVE_TIMEOUT_S`` or 600.

    An environment setting rather than a config field because it depends on the cluster (network, filesystem
    speed of the slowest save), not on the run; the same reason DeepSpeed reads ``DEEPSPEED_TIMEOUT``.
    """
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` comes from the communication backend (timeout, peer closed the connection, ...)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(w in text for w in ("gloo", "nccl", "timed out", "connection"))


def named_failure(rank: int, what: str, err: RuntimeError) -> CollectiveError:
    """``err``, a communication failure, as a `CollectiveError` that names this rank and what it was doing."""
    return CollectiveError(
        f"rank {rank}: {what} failed: a peer rank died or did not answer within "
        f"{collective_timeout_s():.0f} s ({TIMEOUT_ENV}): {str(err).splitlines()[0]}"
    )


def guarded_collective(rank: int, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; a communication failure (peer gone, timeout) is re-raised as `named_failure`."""
    try:
        return fn()
    except RuntimeError as err:
        if isinstance(err, CollectiveError) or not is_collective_failure(err):
            raise
        raise named_failure(rank, what, err) from err


class Watchdog:
    """Ends this process when a guarded region (one training step) runs longer than 1.5x the collective timeout.

    ``arm(what)`` / ``disarm()`` cost a lock and a notify; the thread sleeps on a condition variable in between.
    On expiry it logs ``what``, dumps every thread's stack to stderr (where the rank is stuck) and calls
    ``os._exit(EXIT_HUNG)``: a stuck rank cannot be unwound from another thread, and its peers have already
    failed their collectives with a timeout error.

    That thread needs the GIL, which C code can hold for as long as it runs (a kernel or extension that never
    releases it). So each ``arm`` also sets the stdlib's C-level backstop, ``faulthandler.dump_traceback_later``,
    ``backstop_grace_s`` later: it needs no GIL, dumps every thread's stack and exits with status 1 if the Python
    watchdog has not ended the process by then. ``disarm`` cancels it. It is process-wide: one per process.
    """

    def __init__(self, collective_timeout: float, rank: int, backstop_grace_s: float = BACKSTOP_GRACE_S) -> None:
        # Longer than the collective timeout, so the ranks waiting on a stuck peer fail first, with a Python error.
        self.timeout_s, self.rank = 1.5 * collective_timeout, rank
        self.backstop_grace_s = backstop_grace_s
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pipeline-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str) -> None:
        with self._cond:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
            faulthandler.dump_traceback_later(self.timeout_s + self.backstop_grace_s, exit=True, file=sys.stderr)
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            faulthandler.cancel_dump_traceback_later()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed, self._deadline = True, None
            faulthandler.cancel_dump_traceback_later()
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    self._fire()
                self._cond.wait(remaining)

    def _fire(self) -> None:
        log.error(
            "rank %d: %s did not finish within %.0f s (1.5x %s): this rank is stuck; stacks of every thread "
            "follow; exiting with code %d",
            self.rank,
            self._what,
            self.timeout_s,
            TIMEOUT_ENV,
            EXIT_HUNG,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_HUNG)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    context_parallel: int = 1
    """Ranks per context-parallel group: consecutive ranks (``rank = dp_rank * context_parallel + cp_rank``), so
    a group's point-to-point halo exchanges stay within a node."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of each global batch it trains on (with its CP group)."""
        return self.rank // self.context_parallel

    @property
    def dp_size(self) -> int:
        return self.world_size // self.context_parallel

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (which span of the sequence it runs)."""
        return self.rank % self.context_parallel


def world_size_from_env() -> int:
    """World size the launcher announced (1 for a plain ``python`` run); read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank_from_env() -> int:
    """This process's index on its node, which is its CUDA device (read before any process group exists)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(engine: str, timeout_s: float | None = None) -> DistInfo:
    """Create the process group for ``engine`` and pick this rank's device.

    DeepSpeed and FSDP2 need a process group even on one rank, so a plain ``python`` launch gets a
    single-rank group on a free loopback port. ``parallel.engine=none`` creates a group only when a launcher
    started more than one rank (then the model is wrapped in DDP). ``timeout_s`` (default:
    `collective_timeout_s`) bounds every collective.
    """
    if timeout_s is None:
        timeout_s = collective_timeout_s()
    rank, world = rank_from_env(), world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "LOCAL_WORLD_SIZE" not in os.environ and "LOCAL_SIZE" in os.environ:
        # The deepspeed launcher says LOCAL_SIZE; streaming (one shard-cache leader per node) and the thread
        # count below read torchrun's LOCAL_WORLD_SIZE.
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_SIZE"]
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # CPU ranks share the cores; more intra-op threads than cores makes every small op spin and wait.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    needs_group = world > 1 or engine in ("deepspeed", "fsdp")
    if needs_group and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
                RANK=str(rank),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(world),
            )
        if engine == "deepspeed":
            import deepspeed

            # On CPU this also JIT-builds DeepSpeed's shm comm op once (~60 s, cached in ~/.cache/torch_extensions).
            deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device)


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's legacy global RNG and ``random``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def isolated_rng() -> Iterator[None]:
    """Run the block on a copy of torch's RNG state (CPU and this process's CUDA device) and restore it after.

    The training RNG (Gumbel top-k noise) is checkpointed and restored exactly; a draw outside the training step
    (building the export model, evaluation) would advance it, so a resumed run, or a run that saves or evaluates
    at other steps, would draw other noise from then on.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def mean_weight_sum(weights: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of ``weights`` (this rank's loss weights ``[B, T]`` of one step, aligned with the tokens as labels)
    over the predicted positions ``w[:, 1:]``, averaged over all ranks: a device tensor, from one all-reduce and no
    host sync. The ranks of a context-parallel group hold the same sequences, so this is the global batch's weight
    sum divided by the data-parallel degree."""
    local = torch.stack([w[:, 1:].sum() for w in weights]).sum()
    return all_reduce_mean(local.to(device))


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def all_gather_flags(flag: bool, device: torch.device) -> list[bool]:
    """Every rank's ``flag`` (so an error can name the offending ranks)."""
    mine = torch.tensor([1.0 if flag else 0.0], device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [flag]
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [bool(t.item()) for t in out]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable; peers are trusted processes of this run)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

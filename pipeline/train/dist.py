"""The distributed environment: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

``init_distributed`` picks the device and backend (NCCL on CUDA, gloo on CPU), creates the process group the
chosen engine needs, and returns a ``DistInfo``. The small collectives below (``all_reduce_*``, ``barrier``,
``*_object``) are no-ops when no process group exists, so single-process runs use the same trainer code.
``check_launch`` refuses contradicting launcher variables (`launch_env`) and bad timeout budgets before any work.

Hangs are bounded twice, by two budgets: the start-up budget (``PIPE_STARTUP_TIMEOUT_S``, default 600 s) for the
rendezvous, everything up to the end of the first step (model build, checkpoint load, compiles) and the work
between steps (evaluation, checkpoint saves), and the step budget (``PIPE_STEP_TIMEOUT_S``, default 300 s) for each
later step; ``PIPE_COLLECTIVE_TIMEOUT_S``, when set, is the default of both. Every collective waits at most the
budget in force (`apply_budget`), so a rank waiting for a stuck peer raises instead of waiting forever, naming the
ranks that did not answer (`silent_ranks`). The stuck rank itself (in a sleep, an I/O wait, a C call) is ended by
``Watchdog``: when one training step outlasts 1.5x its budget, it logs which step hung, dumps every thread's stack
and exits with `EXIT_HUNG`, so every rank ends with a clear error in bounded time.
"""

from __future__ import annotations

import faulthandler
import hashlib
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
import torch.distributed.distributed_c10d as c10d

from pipeline.train import deepspeed_cpu, launch_env
from pipeline.train.launch_env import STARTUP_ENV, STEP_ENV, TIMEOUT_ENV

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_STARTUP_S = 600
DEFAULT_STEP_S = 300
WAIT_LOG_EVERY_S = 30.0
"""How often a rank waiting in the rendezvous says so."""
CENSUS_GRACE_S = 10.0
"""How long a rank whose collective failed waits for its peers to report alive (`silent_ranks`)."""
STORE_KEY = "gca-pretrain"
"""Prefix of this module's keys in the job's key-value store."""
EXIT_HUNG = 124
"""Exit code of a process the watchdog ended (the code ``timeout(1)`` uses)."""
BACKSTOP_GRACE_S = 10.0
"""How long after the watchdog's deadline its C-level backstop (``faulthandler``) ends a process whose GIL is held."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died or hangs); the message names the step and the phase."""


@dataclass(frozen=True)
class Budget:
    """How long a collective may wait for its peers, and the variable that set it (named in every timeout error)."""

    seconds: float
    source: str

    def __str__(self) -> str:
        return f"{self.seconds:g} s ({self.source})"


def _budget(name: str, default: float) -> Budget:
    legacy = launch_env.number(os.environ, TIMEOUT_ENV)  # checked even when both budgets are set: no typo unseen
    own = launch_env.number(os.environ, name)
    if own is not None:
        return Budget(own, name)
    if legacy is not None:
        return Budget(legacy, TIMEOUT_ENV)
    return Budget(default, name)


def startup_budget() -> Budget:
    """The start-up budget: ``$PIPE_STARTUP_TIMEOUT_S``, else ``$PIPE_COLLECTIVE_TIMEOUT_S``, else 600 s.

    It bounds the rendezvous, every collective up to the end of the first step of this process (building and
    sharding the model, the checkpoint load, the compiles of the first step) and the work between steps, whose
    slowest rank may legitimately take long (an evaluation, a checkpoint save to a slow file system). Environment
    settings rather than config fields because they depend on the cluster (network, file system speed), not on the
    run; the same reason DeepSpeed reads ``DEEPSPEED_TIMEOUT``.
    """
    return _budget(STARTUP_ENV, DEFAULT_STARTUP_S)


def step_budget() -> Budget:
    """The step budget: ``$PIPE_STEP_TIMEOUT_S``, else ``$PIPE_COLLECTIVE_TIMEOUT_S``, else 300 s. It bounds each
    training step after the first: once steps flow, a rank that stops answering holds every other rank only this
    long."""
    return _budget(STEP_ENV, DEFAULT_STEP_S)


def collective_timeout_s() -> float:
    """Seconds a collective between steps may wait for its peers: the start-up budget's (`startup_budget`)."""
    return startup_budget().seconds


def check_launch() -> None:
    """Refuse, before any work, a malformed numeric variable (the timeout budgets and the launcher's among them) and
    launcher variables that contradict each other (`launch_env.check`).

    Raises:
        launch_env.LaunchEnvError: one line naming the variable(s) and value(s).
    """
    launch_env.check(os.environ)


_in_force: Budget | None = None
"""The budget `apply_budget` last gave the process groups."""


def budget_in_force() -> Budget:
    return _in_force if _in_force is not None else startup_budget()


def apply_budget(budget: Budget) -> None:
    """Make ``budget`` the timeout of every later collective on every process group of this rank.

    The engines' own groups (FSDP's device mesh, DeepSpeed's clone of the world) get torch's default timeout when
    they are made (10 min under NCCL, 30 under gloo), not the one of the group they were made from; each is set
    here too. Setting a timeout is local to this rank and costs no communication.
    """
    global _in_force
    _in_force = budget
    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=budget.seconds)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` comes from the communication backend (timeout, peer closed the connection, ...)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(w in text for w in ("gloo", "nccl", "timed out", "connection"))


def _job_store(timeout_s: float) -> dist.Store | None:
    """The job's key-value store, each request bounded by ``timeout_s``: the process group's once it exists, before
    that the one torchrun's agent hosts for its workers; None without either (or when it does not answer).

    Only for a process about to exit: the timeout is set on the store the process group shares.
    """
    timeout = timedelta(seconds=timeout_s)
    try:
        if dist.is_initialized():
            store = c10d._get_default_store()
            store.set_timeout(timeout)
            return store
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host, port = os.environ["MASTER_ADDR"], launch_env.integer(os.environ, "MASTER_PORT", 0)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            return dist.PrefixStore(f"attempt_{restart}", agent)  # a restarted job must report again
    except (RuntimeError, KeyError, ValueError):  # DistError is a RuntimeError: the store's host is gone or frozen
        return None
    return None


def first_to_say(key: str) -> bool:
    """Whether this rank is the first of the job to report ``key`` (an error every rank may hit alike): one line for
    the job instead of one per rank, as torchtitan's and llm-foundry's users expect. Ranks whose error differs
    report it too, and so does every rank when there is no store to ask (a launcher other than torchrun, before the
    process group exists): a line too many rather than an error no rank reports."""
    store = _job_store(CENSUS_GRACE_S)
    if store is None:
        return True
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    try:
        return int(store.add(f"{STORE_KEY}/said/{digest}", 1)) == 1
    except RuntimeError:
        return True


def silent_ranks(grace_s: float) -> list[int] | None:
    """After a failed collective: the ranks that did not report within ``grace_s`` that they still run.

    Every rank whose collective fails reports here, and the peers of a stuck rank fail together (the same
    collective, the same timeout), so the ranks missing at the end are the stuck or dead ones. The wait ends early
    when every rank reported (the failure was not a silent peer). None when the store does not answer (its host is
    the stuck rank) or there is no process group.
    """
    if not dist.is_initialized():
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    store = _job_store(grace_s)
    if store is None:
        return None
    try:
        store.set(f"{STORE_KEY}/alive/{me}", "1")  # before the count, so a full count means every key is there
        reported = store.add(f"{STORE_KEY}/alive", 1)
        deadline = time.monotonic() + grace_s
        while reported < world and time.monotonic() < deadline:
            time.sleep(0.2)
            reported = store.add(f"{STORE_KEY}/alive", 0)
        return [r for r in range(world) if not store.check([f"{STORE_KEY}/alive/{r}"])]
    except RuntimeError:
        return None


def _census() -> str:
    """What `silent_ranks` found, for an error message. It waits a quarter of the budget at most: the peers of a
    stuck rank report before that rank's own watchdog (1.5x the budget from its step's start) ends it and the
    launcher stops every rank."""
    silent = silent_ranks(min(CENSUS_GRACE_S, budget_in_force().seconds / 4))
    if silent is None:
        return ""
    if not silent:
        return "; every rank still runs"
    return f"; no answer from rank(s) {silent}"


def named_failure(rank: int, what: str, err: RuntimeError) -> CollectiveError:
    """``err``, a communication failure, as a `CollectiveError` that names this rank, what it was doing, the budget
    it waited for and the ranks that did not answer."""
    return CollectiveError(
        f"rank {rank}: {what} failed: a peer rank died or did not answer within {budget_in_force()}"
        f"{_census()}: {str(err).splitlines()[0]}"
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
    """Ends this process when a guarded region (one training step) runs longer than 1.5x its budget.

    ``arm(what, budget)`` / ``disarm()`` cost a lock and a notify; the thread sleeps on a condition variable in
    between. On expiry it logs ``what``, dumps every thread's stack to stderr (where the rank is stuck) and calls
    ``os._exit(EXIT_HUNG)``: a stuck rank cannot be unwound from another thread, and its peers have already
    failed their collectives with a timeout error.

    That thread needs the GIL, which C code can hold for as long as it runs (a kernel or extension that never
    releases it). So each ``arm`` also sets the stdlib's C-level backstop, ``faulthandler.dump_traceback_later``,
    ``backstop_grace_s`` later: it needs no GIL, dumps every thread's stack and exits with status 1 if the Python
    watchdog has not ended the process by then. ``disarm`` cancels it. It is process-wide: one per process.

    Args:
        collective_timeout: seconds, the budget of an ``arm`` that names none (read as ``PIPE_COLLECTIVE_TIMEOUT_S``).
        rank: this process's rank, for the message.
    """

    def __init__(self, collective_timeout: float, rank: int, backstop_grace_s: float = BACKSTOP_GRACE_S) -> None:
        self.default_budget, self.rank = Budget(collective_timeout, TIMEOUT_ENV), rank
        self.backstop_grace_s = backstop_grace_s
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._budget = self.default_budget
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pipeline-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, budget: Budget | None = None) -> None:
        # Longer than the budget, so the ranks waiting on a stuck peer fail first, with a Python error.
        budget = budget or self.default_budget
        with self._cond:
            self._deadline, self._what, self._budget = time.monotonic() + 1.5 * budget.seconds, what, budget
            faulthandler.dump_traceback_later(1.5 * budget.seconds + self.backstop_grace_s, exit=True, file=sys.stderr)
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
            "rank %d: %s did not finish within %.0f s (1.5x its %g s budget, %s): this rank is stuck; stacks of "
            "every thread follow; exiting with code %d",
            self.rank,
            self._what,
            1.5 * self._budget.seconds,
            self._budget.seconds,
            self._budget.source,
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
    return launch_env.integer(os.environ, "WORLD_SIZE", 1)


def rank_from_env() -> int:
    return launch_env.integer(os.environ, "RANK", 0)


def local_rank_from_env() -> int:
    """This process's index on its node, which is its CUDA device (read before any process group exists)."""
    return launch_env.integer(os.environ, "LOCAL_RANK", 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RendezvousError(RuntimeError):
    """The ranks did not all meet within the start-up budget; the message is one line."""


@contextmanager
def _saying_while_waiting(what: str, budget: Budget) -> Iterator[None]:
    """Log every `WAIT_LOG_EVERY_S` (a third of a shorter budget) that ``what`` still waits, until the block ends:
    a rank waiting for peers that never come says so instead of nothing."""
    every = min(WAIT_LOG_EVERY_S, budget.seconds / 3)
    done = threading.Event()
    start = time.monotonic()

    def say() -> None:
        while not done.wait(every):
            log.warning("%s for %.0f s; giving up after %s", what, time.monotonic() - start, budget)

    thread = threading.Thread(target=say, name="pipeline-rendezvous-wait", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _rendezvous(engine: str, backend: str, rank: int, world: int, budget: Budget) -> None:
    """Join the process group at ``MASTER_ADDR:MASTER_PORT``, giving up after ``budget`` with a `RendezvousError`."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = timedelta(seconds=budget.seconds)
    try:
        with _saying_while_waiting(f"rank {rank}: waiting for the other ranks at {where} (world size {world})", budget):
            if engine == "deepspeed":
                # On CPU this also JIT-builds DeepSpeed's shm comm op once per venv (~60 s) and creates this rank's
                # /dev/shm buffer, unlinked once every rank has mapped it (`deepspeed_cpu`).
                deepspeed_cpu.use_venv_extensions()
                import deepspeed

                with deepspeed_cpu.releasing_shm_buffer(rank, world, dist.barrier):
                    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    except dist.DistError as err:
        cause = str(err).splitlines()[0].rstrip(".")
        raise RendezvousError(
            f"rank {rank}: the {world} ranks did not all meet at {where} within {budget}: {cause}; every rank must "
            "be started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
        ) from err


def init_distributed(engine: str, timeout_s: float | None = None) -> DistInfo:
    """Create the process group for ``engine`` and pick this rank's device.

    DeepSpeed and FSDP2 need a process group even on one rank, so a plain ``python`` launch gets a
    single-rank group on a free loopback port. ``parallel.engine=none`` creates a group only when a launcher
    started more than one rank (then the model is wrapped in DDP). The rendezvous and every collective until the
    next `apply_budget` wait at most ``timeout_s`` (default: the start-up budget).

    Raises:
        RendezvousError: the other ranks did not come within that time.
    """
    budget = startup_budget() if timeout_s is None else Budget(timeout_s, "the caller's timeout")
    rank, world = rank_from_env(), world_size_from_env()
    local_rank = local_rank_from_env()
    if "LOCAL_WORLD_SIZE" not in os.environ and "LOCAL_SIZE" in os.environ:
        # The deepspeed launcher says LOCAL_SIZE; streaming (one shard-cache leader per node) and the thread
        # count below read torchrun's LOCAL_WORLD_SIZE.
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_SIZE"]
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # CPU ranks share the cores; more intra-op threads than cores makes every small op spin and wait.
        local_world = launch_env.integer(os.environ, "LOCAL_WORLD_SIZE", 1)
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
        _rendezvous(engine, backend, rank, world, budget)
    apply_budget(budget)
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


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over every rank (itself when there is one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
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

"""The distributed environment: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

``init_distributed`` picks the device and backend (NCCL on CUDA, gloo on CPU), creates the process group the
chosen engine needs, and returns a ``DistInfo``. The small collectives below (``all_reduce_*``, ``barrier``)
are no-ops when no process group exists, so single-process runs use the same trainer code.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """World size the launcher announced (1 for a plain ``python`` run); read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(engine: str, timeout_s: int = 600) -> DistInfo:
    """Create the process group for ``engine`` and pick this rank's device.

    DeepSpeed and FSDP2 need a process group even on one rank, so a plain ``python`` launch gets a
    single-rank group on a free loopback port. ``parallel.engine=none`` creates a group only when a launcher
    started more than one rank (then the model is wrapped in DDP).
    """
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
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK=str(rank),
                              LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
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


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


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


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

"""What this host can give a job, read before the job starts: memory and free disk.

Training and evaluation compare their own estimate with these readings and refuse, in one line, a run that cannot
fit, instead of a silent SIGKILL from the kernel's OOM killer or a numpy ``MemoryError`` traceback after the
export or the data has loaded. Every reading is an upper bound of what the job can get (other processes may take
part of it, and the estimates are lower bounds), so a refusal never stops a run that would have fit.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup hierarchies are mounted: v2 here (or under ``unified/`` on a hybrid host), v1's memory
controller under ``memory/``."""
PROC_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroup in each hierarchy: ``<id>:<controllers>:<path>`` (v2: ``0::<path>``)."""
UNLIMITED = 1 << 60
"""cgroup v1 writes no limit as a huge number (9223372036854771712)."""


@dataclass(frozen=True)
class Memory:
    """The most memory a new allocation of this process can get, and which limit says so."""

    bytes: int
    limit: str


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    return {m[1]: int(m[2]) * 1024 for m in re.finditer(r"^(\w+):\s+(\d+) kB", text, re.M)}


def _cgroup_file(directory: Path, name: str) -> int | None:
    """A cgroup limit file as bytes; None for no limit (``max``, v1's huge number) or a file that is not there."""
    try:
        text = (directory / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < UNLIMITED else None


def _ancestors(root: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``root`` and each one above it: every level's limit applies."""
    directory = root / path.lstrip("/")
    return [directory, *(d for d in directory.parents if d == root or root in d.parents)]


def _cgroup_limit(swap_free: int) -> Memory | None:
    """The tightest memory limit of this process's cgroups and their ancestors, with the swap it may use: v2
    ``memory.max`` plus ``memory.swap.max`` (swap on top), v1 ``memory.limit_in_bytes`` plus free swap, capped by
    ``memory.memsw.limit_in_bytes`` (memory and swap together). The whole limit, not limit minus usage: usage
    counts page cache the kernel reclaims on demand."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    found: list[Memory] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:  # v2
            for directory in (d for root in (CGROUP_ROOT, CGROUP_ROOT / "unified") for d in _ancestors(root, path)):
                memory = _cgroup_file(directory, "memory.max")
                if memory is not None:
                    swap = _cgroup_file(directory, "memory.swap.max")
                    extra = swap_free if swap is None else min(swap, swap_free)
                    found.append(Memory(memory + extra, f"cgroup {directory / 'memory.max'} + swap"))
        elif "memory" in controllers.split(","):  # v1
            for directory in _ancestors(CGROUP_ROOT / "memory", path):
                memory = _cgroup_file(directory, "memory.limit_in_bytes")
                if memory is not None:
                    total = _cgroup_file(directory, "memory.memsw.limit_in_bytes")
                    limit = memory + swap_free if total is None else min(memory + swap_free, total)
                    found.append(Memory(limit, f"cgroup {directory / 'memory.limit_in_bytes'} + swap"))
    return min(found, key=lambda m: m.bytes, default=None)


def _address_space_left() -> int | None:
    """``ulimit -v`` less the address space this process already maps; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        found = re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        found = None
    mapped = int(found[1]) * 1024 if found else 0  # unknown: the whole limit, an upper bound
    return max(soft - mapped, 0)


def available_memory() -> Memory | None:
    """The most memory this process can still allocate: ``MemAvailable`` plus free swap, within its cgroup's
    limit and its ``ulimit -v``; None where nothing can be read (not Linux)."""
    info = _meminfo()
    if "MemAvailable" not in info:
        return None
    swap_free = info.get("SwapFree", 0)
    found = [Memory(info["MemAvailable"] + swap_free, "MemAvailable + SwapFree")]
    cgroup = _cgroup_limit(swap_free)
    if cgroup is not None:
        found.append(cgroup)
    address_space = _address_space_left()
    if address_space is not None:
        found.append(Memory(address_space, "ulimit -v"))
    return min(found, key=lambda m: m.bytes)


def free_disk_bytes(path: str | os.PathLike) -> int:
    """Free bytes of the file system holding ``path`` (an existing directory)."""
    return shutil.disk_usage(path).free


def gib(n: int) -> str:
    """Bytes as GiB for a message."""
    return f"{n / 2**30:.1f} GiB"

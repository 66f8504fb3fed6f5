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
    """A cgroup v2 limit file as bytes; None for ``max`` or a file that is not there."""
    try:
        text = (directory / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_limit(swap_free: int) -> int | None:
    """The tightest memory limit (plus the swap it may use) of this process's cgroup v2 and its ancestors. The
    whole limit, not limit minus usage: usage counts page cache the kernel reclaims on demand."""
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    directory = CGROUP_ROOT / line[3:].lstrip("/")
    limits = []
    while directory == CGROUP_ROOT or CGROUP_ROOT in directory.parents:
        memory = _cgroup_file(directory, "memory.max")
        if memory is not None:
            swap = _cgroup_file(directory, "memory.swap.max")
            limits.append(memory + min(swap if swap is not None else swap_free, swap_free))
        if directory == CGROUP_ROOT:
            break
        directory = directory.parent
    return min(limits, default=None)


def _address_space_left() -> int | None:
    """``ulimit -v`` less the address space this process already maps; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        mapped = int(re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024  # type: ignore[index]
    except (OSError, TypeError):
        mapped = 0
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
        found.append(Memory(cgroup, "the cgroup's memory.max (+ swap)"))
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

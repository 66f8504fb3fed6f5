"""``flush_denormals`` reaches every intra-op worker thread when called first (it is a per-thread CPU flag)."""

import subprocess
import sys
import textwrap

import pytest
import torch

_PROBE = textwrap.dedent(
    """
    import sys, torch
    from kernels.cpu_math import flush_denormals
    torch.set_num_threads(2)
    if sys.argv[1] == "late":  # the thread pool starts before the flag is set
        torch.ones(1 << 22).mul_(2)
    if sys.argv[1] in ("first", "late"):
        assert flush_denormals()
    # 1e-30 * 1e-10 = 1e-40 is an fp32 denormal: 0 where flushing is on. The elementwise multiply of 4M values
    # is split over the worker threads, so every thread's setting shows up in the result.
    x = torch.full((1 << 22,), 1e-30) * torch.full((1 << 22,), 1e-10)
    print(int((x != 0).sum()))
    """
)


def _nonzero(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="this CPU has no flush-to-zero mode")
def test_flush_reaches_all_threads_only_when_called_first():
    assert _nonzero("keep") == 1 << 22  # denormals survive by default
    assert _nonzero("first") == 0
    # Called after the pool exists, only the calling thread flushes: the workers' share stays denormal.
    assert 0 < _nonzero("late") < 1 << 22


_ALLOC_PROBE = textwrap.dedent(
    """
    import sys, torch
    from kernels.cpu_math import retain_freed_memory
    if sys.argv[1] == "retain":
        assert retain_freed_memory()
    def rss_kb():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
    x = torch.empty(1 << 24).fill_(1.0)  # 64 MB, resident
    before = rss_kb()
    del x
    print(before - rss_kb())  # how much the free gave back to the OS
    """
)


def _released_kb(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _ALLOC_PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator setting, /proc")
def test_retained_memory_stays_with_the_process():
    assert _released_kb("default") > 60_000  # by default a 64 MB buffer is its own mapping, unmapped on free
    assert _released_kb("retain") < 4_000  # retained: the heap keeps it for the next allocation

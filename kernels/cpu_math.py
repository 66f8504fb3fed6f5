"""Process-wide CPU settings for fast training and evaluation: denormal flushing, and (training) an allocator
that keeps freed memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import warnings

import torch


def flush_denormals() -> bool:
    """Flush fp32/fp64 denormals to zero (x86 FTZ/DAZ) in this process; returns whether the CPU supports it.

    ALiBi pushes far keys ~100 nats below the row maximum, so softmax backward kernels spend much of their time on
    denormal ``exp`` results, which x86 handles ~10x slower than normal numbers (the CPU sliding-window step is
    ~2x slower without this). Values below 1.2e-38 carry no information for training; GPUs flush them too.

    Call it before the first multi-threaded torch op: OpenMP worker threads copy the floating-point control
    register when they are created, so a call after the thread pool exists only affects the calling thread.
    """
    # numpy notices flushed denormals when it computes float limits and warns once per type; that is this setting.
    warnings.filterwarnings("ignore", message="The value of the smallest subnormal", category=UserWarning)
    return torch.set_flush_denormal(True)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    """Serve every allocation from the heap and never give freed heap memory back to the OS (glibc only);
    returns whether the setting took effect.

    A training step allocates and frees the same large activation and gradient buffers every step. By default
    glibc maps each buffer over 32 MB freshly (``mmap``) and unmaps it on free, so every step pays a page fault per
    4 KB page on first touch: measured 9-14% of a CPU training step (``make bench-train`` models at 4K tokens: GCA
    2.19 s -> 1.88 s, the sliding-window model 1.72 s -> 1.57 s). With mmap off and trimming off, freed buffers are
    reused from the heap. The price: the resident size stays at its high-water mark, which fragmentation makes
    higher (same benchmark, 12 steps: plateau 2.8 GB from step 7 vs a 2.4 GB peak by default).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl without mallopt): keep the default
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))

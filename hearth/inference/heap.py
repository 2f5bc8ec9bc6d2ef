"""Hands heap memory the process has freed back to the operating system, where the C library keeps it otherwise.

Why: glibc's malloc keeps freed memory mapped, and counted in the process's resident memory, whenever it is not at
the top of an arena (fragments between live blocks), and raises its mmap threshold once a large block is freed, so
after loading a model the temporaries of a prefill and the KV caches of finished sessions are served from arenas and
stay resident after they are freed. A shard calls `release_freed_heap` after quantizing its layers and whenever a
session's caches are dropped (BENCHMARKS.md, "Quantized shard kernels").

What `malloc_trim` leaves: the free memory at the top of each thread's arena (it trims only the main arena's top),
where a shard's compute thread holds its weights and serves its steps, and a worker thread reads a checkpoint to
hash it. glibc hands a thread's top back only from free(), once it exceeds the trim threshold, which its dynamic
adjustment raises to twice the largest block freed (up to 64 MiB): so a process fixes the thresholds once it has
loaded a model's weights on the CPU (`bound_arena_tops`, from hearth/inference/loading.py). Nothing here runs where
the C library is not glibc (not Linux, or musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

# Blocks up to this size are served from the arenas and reused without page faults: where glibc's dynamic mmap
# threshold ends after a large block is freed (its maximum, which mallopt accepts as the highest).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at an arena's top beyond this goes back to the OS as soon as a block of 64 KiB or more is freed
# (glibc keeps its top pad, 128 KiB, for the next allocations).
TRIM_THRESHOLD_BYTES = 1 << 20
# mallopt(3)'s parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def release_freed_heap() -> None:
    """Return the whole pages of the free chunks of every arena, and the main arena's free top, to the OS (glibc's
    ``malloc_trim(0)``); it runs without the GIL, in milliseconds for a shard's heap."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def bound_arena_tops() -> None:
    """Fix glibc's mmap and trim thresholds (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES) for this process, so that
    the free top of every arena, a thread's included, stays within TRIM_THRESHOLD_BYTES; idempotent. Fixing them
    ends glibc's dynamic adjustment: the mmap threshold is set where that adjustment would take it. Called once a
    model's weights are loaded, not before: loading under the dynamic thresholds reuses the quantization's
    temporaries instead of handing them back and faulting them in again at each layer."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, None where the C library is not glibc."""
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc on Linux (malloc_trim is glibc's own: musl has none), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None

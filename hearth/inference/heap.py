"""Hands heap memory the process has freed back to the operating system, where the C library keeps it otherwise.

Why: glibc's malloc keeps freed memory mapped, and counted in the process's resident memory, whenever it is not at
the top of an arena (fragments between live blocks), and raises its mmap threshold once a large block is freed, so
after loading a model the temporaries of a prefill and the KV caches of finished sessions are served from arenas and
stay resident after they are freed. A shard calls `release_freed_heap` after quantizing its layers and whenever a
session's caches are dropped (BENCHMARKS.md, "Quantized shard kernels").

What `malloc_trim` leaves: the free memory at the top of each thread's arena (it trims only the main arena's top),
where a shard's compute thread holds its weights and serves its steps, and a worker thread reads a checkpoint to
hash it. glibc hands a thread's top back only from free(), once it exceeds the trim threshold, which its dynamic
adjustment raises to twice the largest block freed (up to 64 MiB), and which a prefill's temporaries need that high
(handed back at every layer, they are faulted in again at the next). So a process fixes the thresholds where that
adjustment ends once it has loaded a model's weights on the CPU (`bound_arena_tops`, from
hearth/inference/loading.py), and `release_freed_heap` lowers the trim threshold for one free on the thread that
calls it, then raises it again. Nothing here runs where the C library is not glibc (not Linux, or musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# Blocks up to this size are served from the arenas and reused without page faults: where glibc's dynamic mmap
# threshold ends after a large block is freed (its maximum, which mallopt accepts as the highest).
MMAP_THRESHOLD_BYTES = 32 << 20
# While a process computes, free memory at an arena's top is kept up to this (where glibc's dynamic trim threshold
# ends: twice the mmap threshold), so a prefill's temporaries are reused from one layer to the next instead of
# handed back and faulted in again.
TRIM_THRESHOLD_BYTES = 64 << 20
# What release_freed_heap leaves at the top of its thread's arena (glibc keeps its top pad, 128 KiB, besides).
RELEASED_TOP_BYTES = 1 << 20
# A block this large, freed, makes free() look at its arena's top and trim what is beyond the threshold (glibc does
# so for frees of 64 KiB or more).
_TRIM_TRIGGER_BYTES = 128 << 10
# mallopt(3)'s parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Whether bound_arena_tops fixed the thresholds in this process (release_freed_heap changes them only then).
_bounded = False


def release_freed_heap() -> None:
    """Return to the OS the whole pages of the free chunks of every arena and the main arena's free top (glibc's
    ``malloc_trim(0)``), and, once the thresholds are fixed (bound_arena_tops), the free top of the calling thread's
    own arena beyond RELEASED_TOP_BYTES, which ``malloc_trim`` leaves: call it on the thread that computed (a shard's
    compute thread at a call's end, a worker after reading a checkpoint). It runs without the GIL, in milliseconds
    for a shard's heap."""
    libc = _glibc()
    if libc is None:
        return
    libc.malloc_trim(0)
    if _bounded:
        # glibc trims a thread's arena top only from free(), past the trim threshold: lowered for one free here,
        # then raised again so that the next call's steps keep their temporaries.
        libc.mallopt(_M_TRIM_THRESHOLD, RELEASED_TOP_BYTES)
        libc.free(libc.malloc(_TRIM_TRIGGER_BYTES))
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def bound_arena_tops() -> None:
    """Fix glibc's mmap and trim thresholds for this process where its dynamic adjustment ends (MMAP_THRESHOLD_BYTES,
    TRIM_THRESHOLD_BYTES), so that release_freed_heap can lower the trim threshold for a moment and raise it again
    (setting one ends the dynamic adjustment of both); idempotent. Called once a model's weights are loaded, when
    the dynamic thresholds have reached those values or nearly."""
    global _bounded
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        _bounded = True


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc on Linux (malloc_trim is glibc's own: musl has none), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("malloc_trim", "mallopt", "malloc", "free")):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc

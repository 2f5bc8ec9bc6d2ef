"""Hands heap memory the process has freed back to the operating system, where the C library keeps it otherwise.

Why: glibc's malloc keeps freed memory mapped, and counted in the process's resident memory, whenever it is not at
the top of an arena (fragments between live blocks), and raises its mmap threshold once a large block is freed, so
after loading a model the temporaries of a prefill and the KV caches of finished sessions are served from arenas and
stay resident after they are freed. A shard calls this after quantizing its layers and whenever a session's caches
are dropped (BENCHMARKS.md, "Quantized shard kernels"). A no-op where the C library has no ``malloc_trim`` (not
Linux, or not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


def release_freed_heap() -> None:
    """Return the whole pages of every arena's free memory to the OS (glibc's ``malloc_trim(0)``); it runs without
    the GIL, in milliseconds for a shard's heap."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None

"""The one thread of a process that runs torch work, so every step runs on the same warm OpenMP thread team.

Why not `asyncio.to_thread`: its pool hands work to whichever of several threads is free, and libgomp keeps
a separate OpenMP team for every thread that starts parallel work. Once a process has more OpenMP threads
than the machine has cores, libgomp stops spinning between parallel regions ("throttled" waiting) and every
region pays a futex wake-up, which on a small VM costs a step a third of its speed (BENCHMARKS.md, "Compute
thread and OpenMP spinning"). One long-lived thread keeps one team, and the steps of a process run one at a
time anyway (a layer range or a head is not shared by two computations at once).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

COMPUTE_THREAD_NAME = "hearth-compute"

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def compute_executor() -> ThreadPoolExecutor:
    """This process's compute thread (started on first use; interpreter exit joins it like any pool)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=COMPUTE_THREAD_NAME)
        return _executor


async def on_compute_thread(function: Callable[..., T], /, *args, **kwargs) -> T:
    """Run `function(*args, **kwargs)` on the compute thread without blocking the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(compute_executor(), functools.partial(function, *args, **kwargs))

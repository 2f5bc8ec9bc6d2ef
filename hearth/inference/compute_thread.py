"""The one thread of a process that runs torch work, so every step runs on the same warm OpenMP thread team.

Why not `asyncio.to_thread`: its pool hands work to whichever of several threads is free, and libgomp keeps
a separate OpenMP team for every thread that starts parallel work. Once a process has more OpenMP threads
than the machine has cores, libgomp stops spinning between parallel regions ("throttled" waiting) and every
region pays a futex wake-up, which on a small VM costs a decode step much of its speed
(BENCHMARKS.md, "Compute thread and OpenMP spinning"). One long-lived thread keeps one team, and the steps
of a process run one at a time anyway (a layer range or a head is not shared by two computations at once); the
one exception, a shard's long prefills on a niced thread of their own, is `prefill_executor`'s.
Loading a model runs there too (torch may start parallel regions while loading, and a second team would bring
the throttling back); the cost: an orchestrator loading a head or its fallback model delays its other pipelines.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

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
    return await on_thread(compute_executor(), function, *args, **kwargs)


async def on_thread(executor: ThreadPoolExecutor, function: Callable[..., T], /, *args, **kwargs) -> T:
    """Run `function(*args, **kwargs)` on `executor`'s thread without blocking the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(function, *args, **kwargs))


PREFILL_THREAD_NAME = "hearth-prefill"

_prefill_executors: dict[int, ThreadPoolExecutor] = {}


def prefill_executor(nice: int) -> ThreadPoolExecutor:
    """This process's thread for long prefill steps, `nice` steps below the process's CPU priority (one per value;
    started on first use).

    Why a second thread: processes that share a machine's cores (a mesh on one box) prefill a long prompt's chunks
    on every hop at once, so a short call's step competes for the cores with the long prompt's turns in the other
    processes; turns inside one process cannot fix that, the OS scheduler can. Linux lets a thread raise its nice
    value but not lower it again without privileges (RLIMIT_NICE is 0 on most hosts), so the compute thread cannot
    drop its priority for a prefill and take it back afterwards: long prefills get a thread of their own, niced for
    good. It runs beside the compute thread (the runner does not hold its lock while a step's layers run), so a
    short step does not wait for a prefill turn to end either. OpenMP threads that a parallel region of that thread
    starts are created by it and inherit its nice value; a second OpenMP team in the process counts against
    libgomp's spinning budget (see the module docstring), which is why shards sharing cores run steps on one
    intra-op thread while several streams are open (StepThreads).
    """
    if not 0 < nice <= 19:
        raise ValueError(f"nice must be within 1..19, not {nice}")
    with _executor_lock:
        if nice not in _prefill_executors:
            _prefill_executors[nice] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=PREFILL_THREAD_NAME,
                                                          initializer=_lower_own_priority, initargs=(nice,))
        return _prefill_executors[nice]


def _lower_own_priority(nice: int) -> None:
    # PRIO_PROCESS with a thread id targets that thread alone on Linux (nice values are per thread there).
    thread_id = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, thread_id, min(19, os.getpriority(os.PRIO_PROCESS, thread_id) + nice))


def use_intra_op_threads(threads: int) -> None:
    """On the compute thread: run the next torch ops with `threads` intra-op threads (free when unchanged)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# A batched step holding every stream uses all threads only over at least this many bytes of weights (StepThreads).
parallel_batch_min_weight_bytes = 32 * 2**20


class StepThreads:
    """How many intra-op threads a step gets: all of this process's while it serves one stream, `busy_threads`
    while it serves several.

    Why: processes that share a machine's cores (a mesh on one box: demo, bench, tests) compute the hops of
    concurrent sessions side by side. Two OpenMP teams of two threads on two cores then time-slice, and a
    team whose threads wait spinning for a descheduled partner wastes its slices: several sessions together
    ran slower than one alone (BENCHMARKS.md, "Compute thread and OpenMP spinning").
    With one thread per step while busy, the hops use the cores in parallel instead. A process alone on its
    machine leaves `busy_threads` unset: its steps run one at a time anyway, so fewer threads only slow them.
    """

    def __init__(self, busy_threads: int | None = None) -> None:
        if busy_threads is not None and busy_threads < 1:
            raise ValueError(f"busy_threads must be at least 1, not {busy_threads}")
        self.busy_threads = busy_threads
        self.alone_threads = torch.get_num_threads()

    def for_streams(self, active_streams: int) -> int:
        if self.busy_threads is not None and active_streams > 1:
            return min(self.busy_threads, self.alone_threads)
        return self.alone_threads

    def for_step(self, rows: int, active_streams: int, weight_bytes: int) -> int:
        """Threads for a batched step of `rows` of the process's `active_streams` streams over `weight_bytes` of
        weights: all of them when it holds every stream (nothing else of this process is in flight elsewhere in the
        mesh, so, as for one stream, the other processes wait for this step) and its products are large enough to
        gain from splitting, `busy_threads` otherwise: a large batched step is faster on every thread, a small
        model's (the bundled one's) slower split (BENCHMARKS.md, "One batch for hops that share cores")."""
        if weight_bytes < parallel_batch_min_weight_bytes:
            return self.for_streams(active_streams)
        return self.for_streams(active_streams - rows + 1)

"""How the processes of a mesh on one machine share its cores: a command pinned to some of them, and the
OpenMP environment of a torch process that shares them with others."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence

# libgomp's spin before a waiting OpenMP thread sleeps, in spin iterations: long enough to bridge the gaps inside a
# step, short enough to leave the cores to the next hop (BENCHMARKS.md, "Compute thread and OpenMP spinning").
openmp_spin_count = 20000


def quiet_torch_environment(threads: int | None) -> dict[str, str]:
    """Environment for a torch child process sharing few cores with others.

    A single session's step runs in one process while the others wait, so it may use every core: its OpenMP
    threads spin briefly between parallel regions (GOMP_SPINCOUNT) instead of sleeping on a futex after each
    of the hundreds of regions of a step, each wake-up costing an inter-processor interrupt to a halted vCPU.
    Spinning long
    (libgomp's default of ~300000 iterations, or OMP_WAIT_POLICY=ACTIVE) steals the cores from the next hop
    once a step is done, so the spin is short and the wait policy passive beyond it; and while a process
    serves several streams its steps use one thread (`--busy-threads`, shared_machine_busy_threads), since
    teams of spinning threads time-slicing two cores collapse (BENCHMARKS.md, "Compute thread and OpenMP
    spinning").
    """
    env = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(openmp_spin_count), "KMP_BLOCKTIME": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def pinned_command(command: list[str], cpus: Sequence[int] | None) -> tuple[list[str], Callable[[], None] | None]:
    """`command` made to run on `cpus` only (None or empty: anywhere), and the preexec_fn Popen needs for it.

    util-linux `taskset -c` when it is installed: it sets the affinity and execs the command, so the pid Popen
    returns is the command's and `ps` shows the pinning; without it, the child pins itself with
    os.sched_setaffinity between fork and exec.
    """
    if not cpus:
        return command, None
    cores = sorted(set(cpus))
    taskset = shutil.which("taskset")
    if taskset is not None:
        return [taskset, "-c", ",".join(str(core) for core in cores), *command], None
    return command, lambda: os.sched_setaffinity(0, cores)

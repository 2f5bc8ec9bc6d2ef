"""What the kernel says about a running process: the cores it may run on and the CPU time it has used (Linux /proc)."""

from __future__ import annotations

import os
from pathlib import Path

_clock_ticks_per_s = os.sysconf("SC_CLK_TCK")


def cpus_allowed(pid: int) -> str:
    """The process's `Cpus_allowed_list` from /proc/<pid>/status, e.g. "0" or "0-1" (what taskset set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Cpus_allowed_list":
            return value.strip()
    raise OSError(f"/proc/{pid}/status has no Cpus_allowed_list")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process (all its threads) has used so far, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold spaces; the fields after it are plain.
    fields = text[text.rindex(")") + 2:].split()
    user_ticks, system_ticks = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (user_ticks + system_ticks) / _clock_ticks_per_s


def own_cpu_seconds() -> float:
    """This process's user plus system CPU seconds (all its threads)."""
    times = os.times()
    return times.user + times.system

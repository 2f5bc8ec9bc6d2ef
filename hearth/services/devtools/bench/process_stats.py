"""What the kernel says about a running process: the cores it may run on, the CPU time it has used and its resident
memory (Linux /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hearth.services.common.hearth_files import SOURCES_ROOT
from hearth.services.devtools.prefork import HEARTH_MODULE

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


# What a shard process imports before it reads a weight: the baseline its RSS holds with no layer loaded. A shard runs
# as `python -m <HEARTH_MODULE> shard`, so the CLI's modules are part of it, and on uvloop's event loop where uvloop is
# installed (hearth/services/common/lifecycle.py).
SHARD_PROCESS_MODULES = ("torch", "transformers.models.llama.modeling_llama", "hearth.inference.loading", HEARTH_MODULE,
                         "hearth.services.shard.main")
SHARD_IMPORTS_PROBE = (f"import {', '.join(SHARD_PROCESS_MODULES)}\n"
                       "try:\n    import uvloop\nexcept ImportError:\n    pass\n"
                       "import dataclasses, json, os\n"
                       "from hearth.services.devtools.bench.process_stats import resident_memory\n"
                       "print(json.dumps(dataclasses.asdict(resident_memory(os.getpid()))))")
baseline_probe_timeout_s = 120.0


@dataclass(frozen=True)
class ResidentMemory:
    """A process's resident memory in MiB (proc(5) status): now, at its peak, and now split into anonymous memory
    (what it allocated: quantized weights, caches) and pages of mapped files (memory-mapped checkpoint tensors,
    shared libraries; shared with the page cache)."""

    rss_mb: float
    peak_rss_mb: float
    anonymous_mb: float
    file_mb: float


def resident_memory(pid: int) -> ResidentMemory:
    """VmRSS, VmHWM, RssAnon and RssFile of the process, from /proc/<pid>/status."""
    values_kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            values_kb[key] = int(value.split()[0])  # "123456 kB"
    if len(values_kb) < 4:
        raise OSError(f"/proc/{pid}/status has no VmRSS/VmHWM/RssAnon/RssFile")
    return ResidentMemory(rss_mb=round(values_kb["VmRSS"] / 1024, 1), peak_rss_mb=round(values_kb["VmHWM"] / 1024, 1),
                          anonymous_mb=round(values_kb["RssAnon"] / 1024, 1),
                          file_mb=round(values_kb["RssFile"] / 1024, 1))


def shard_imports_memory(env: dict[str, str] | None = None) -> ResidentMemory | None:
    """The resident memory of a fresh Python that has imported what a shard imports and loaded no weight: the part
    of a shard's RSS that is not its layers (None where it cannot be measured)."""
    repo_root = SOURCES_ROOT
    try:
        finished = subprocess.run([sys.executable, "-c", SHARD_IMPORTS_PROBE], capture_output=True, text=True,
                                  cwd=repo_root, env={**os.environ, **(env or {})}, timeout=baseline_probe_timeout_s)
        if finished.returncode != 0:
            return None
        return ResidentMemory(**json.loads(finished.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, TypeError):
        return None

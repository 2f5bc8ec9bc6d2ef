"""Keeps what a hearth process holds in memory (prompts, answers, activations, KV, member keys) out of core dumps."""

from __future__ import annotations

import contextlib
import resource


def forbid_core_dumps() -> None:
    """No core file from this process or its children, whatever the shell's `ulimit -c` or the machine's core pattern
    (a core written to the working folder, or handed to systemd-coredump or apport, which honour the limit): the
    limit is 0, soft and hard, so nothing the process runs can raise it again."""
    with contextlib.suppress(ValueError, OSError):  # a platform without the limit: nothing to lower
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

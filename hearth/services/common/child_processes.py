"""Processes of this host: child processes that end with the process that started them (a `hearth demo`, or a test,
killed with SIGKILL leaves no nats-server or hearth process of its own running on: Linux's parent-death signal), and
whether a process id still names a live process."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

# prctl(2)'s option: the signal the calling process gets when its parent ends.
PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def ends_with_this_process(then: Callable[[], None] | None = None) -> Callable[[], None] | None:
    """A Popen preexec_fn that has the child sent SIGTERM when this process ends (where the platform can), then
    runs `then` (another preexec_fn, or None).

    Only from the main thread: the signal comes when the thread that started the child ends, and another thread
    (a pool's worker, say) may end long before the process does."""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return then
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent ended before the child asked: nobody would send the signal
            os._exit(1)
        if then is not None:
            then()

    return preexec


def process_alive(pid: int) -> bool:
    """Whether process `pid` (above 0) lives on this host; another user's counts (signal 0 is refused it, not
    unknown). An id reused by a newer process reads as alive: a caller may only leave something behind, never take
    a live process's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

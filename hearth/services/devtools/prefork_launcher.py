"""The prefork launcher process (services.devtools.prefork): imports every module a `hearth` command loads, then
forks a child for each SpawnRequest read on its stdin and reports on its stdout, until its stdin ends.

Its stdin ends without it being killed first (`PreforkLauncher.close` kills it) only when its owner is gone (SIGKILL,
a crash): it then ends the children still running, which nobody else would stop.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import runpy
import select
import shlex
import signal
import sys
import time
from collections.abc import Sequence

from hearth.services.common.process_gc import freeze_startup_objects, hold_full_collections
from hearth.services.devtools.prefork import (
    HEARTH_MODULE,
    PRELOADED_MODULES,
    ExitReport,
    SpawnReply,
    SpawnRequest,
    launcher_poll_interval_s,
)

# Once its owner is gone, how long the launcher's children get to stop on SIGTERM before SIGKILL (they stop within
# services.common.lifecycle.stop_deadline_s), and how often it looks whether they have.
orphan_stop_timeout_s = 5.0
orphan_poll_interval_s = 0.05


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(request: SpawnRequest, launcher_fds: Sequence[int]) -> None:
    """In the forked child: become the command the request names, run it, and exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in launcher_fds:
            os.close(fd)
        # SIGPIPE stays ignored, as in a fresh interpreter: a write to a closed socket raises BrokenPipeError.
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with contextlib.suppress(ImportError):  # cosmetic: ps would show the launcher's command line instead
            import setproctitle

            setproctitle.setproctitle(shlex.join([sys.executable, "-m", HEARTH_MODULE, *request.argv]))
        if request.new_session:
            os.setsid()
        if request.cpus:
            os.sched_setaffinity(0, request.cpus)
        log_fd = os.open(request.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        import torch

        torch.seed()  # a fresh process draws its own seed; a fork would otherwise share the launcher's
        sys.argv = ["hearth", *request.argv]
        try:
            runpy.run_module("hearth", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child must never return into the launcher's loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        # As lifecycle.end_stopped_process: atexit handlers, flushed streams, no teardown, never back to the loop.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _write(message: SpawnReply | ExitReport) -> None:
    with contextlib.suppress(BrokenPipeError):  # the owner is gone: nobody reads the reports any more
        os.write(1, (message.model_dump_json() + "\n").encode())


def _reap_children(children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _write(ExitReport(pid=pid, returncode=_returncode(status)))


def _end_orphans(children: set[int]) -> None:
    """The owner went (its end of stdin closed) without stopping these children, killed, say: nobody else would
    stop them. SIGTERM, then SIGKILL for those still there after orphan_stop_timeout_s."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + orphan_stop_timeout_s
        while children and time.monotonic() < deadline:
            time.sleep(orphan_poll_interval_s)
            _reap_children(children)


def _serve() -> None:
    """The launcher's loop: import, then fork on each request and report each child's exit, until stdin ends."""
    # Ctrl-C in a terminal reaches the launcher's process group too; the owner decides when it ends (stdin).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    hold_full_collections()  # as a `hearth` command imports (hearth/services/common/process_gc.py)
    for module in PRELOADED_MODULES:
        with contextlib.suppress(ImportError):  # the child imports it again and says what is wrong
            importlib.import_module(module)
    gc.collect()  # once: the freezes keep no garbage, and the children start from Python's own thresholds
    freeze_startup_objects()
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([0, wakeup_read], [], [], launcher_poll_interval_s)
        if wakeup_read in readable:
            os.read(wakeup_read, 4096)
        _reap_children(children)
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = SpawnRequest.model_validate_json(line)
            except ValueError as error:
                _write(SpawnReply(error=f"not a spawn request: {error}"))
                continue
            # What exists goes to the permanent generation: a child's full collections skip it (otherwise one
            # lands on a child's first request: BENCHMARKS.md, "`hearth demo`") and leave its pages, shared with
            # the launcher, untouched (gc.freeze's docs).
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                _run_child(request, (wakeup_read, wakeup_write))
            children.add(pid)
            _write(SpawnReply(pid=pid))
    _reap_children(children)
    _end_orphans(children)


if __name__ == "__main__":
    _serve()

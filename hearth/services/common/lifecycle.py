"""Runs a command's async main until SIGINT/SIGTERM, so every hearth process shuts down the same clean way:
a requested stop ends the process within stop_deadline_s, with exit code 0 and no traceback."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from hearth.services.common.process_gc import freeze_startup_objects
from hearth.services.common.scratch_folders import remove_live_scratch_folders
from hearth.trust.keys import write_private_file

T = TypeVar("T")
log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A requested stop (SIGINT/SIGTERM) is a success: the process did what it was asked.
STOP_EXIT_CODE = 0
# Once a stop is requested, the process is gone after this long whatever it is doing (loading a model on
# a worker thread, waiting for a broker that is down): its own shutdown gets until then.
stop_deadline_s = 1.5
# A command stopped by a signal (run_cancelling_on_signal) is cancelled again this often until it ends: its own
# clean-up (deleting its consumers) fits well inside.
stop_repeat_s = 5.0
# libuv's event loop (uvloop) is used where it is installed: every activation frame crosses two event loops
# per hop, and uvloop's loopback round trip is shorter (BENCHMARKS.md, "`hearth bench`": its gain mostly goes after
# an idle gap, "Compute thread and OpenMP spinning").
# HEARTH_ASYNCIO_LOOP=asyncio picks the stdlib loop.
EVENT_LOOP_ENV = "HEARTH_ASYNCIO_LOOP"


def run_event_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """asyncio.run with uvloop's loop when available (and not switched off by HEARTH_ASYNCIO_LOOP=asyncio), once
    the objects made while starting are frozen out of later garbage collections (process_gc)."""
    freeze_startup_objects()
    if os.environ.get(EVENT_LOOP_ENV, "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:  # not on this platform (uvloop has no Windows build): the stdlib loop is fine
            pass
        else:
            return uvloop.run(coroutine)
    return asyncio.run(coroutine)


class CommandRefused(RuntimeError):
    """A command cannot do what it was asked (a model that does not load, a range that does not fit): the
    command line prints the message as one line and exits 1."""


class CommandInputRefused(CommandRefused):
    """What the command was given cannot be used, as found before it starts anything (a model that does not exist, a
    device or quantization scheme this machine has no kernel for, a memory budget that holds no layer): the command
    line prints the message as one line and exits 2, as for a usage error."""


def write_ready_file(path: str | os.PathLike, text: str) -> None:
    """Write a process's `--ready-file` as the project writes a state file (trust.keys.write_private_file): whole at
    once, through a synced file beside it renamed over it (a script or test waiting for it to exist read it empty when
    it came as the process wrote it; a `hearth host` rewrites it at every move), mode 0600. A link found at `path` is
    refused, not replaced (someone planted it: refused_ready_file says so at start, before any work); this, or any
    other failure to write it, is a CommandRefused in one line."""
    try:
        write_private_file(Path(path), text.encode())
    except OSError as error:
        raise CommandRefused(f"cannot write the ready file {os.fspath(path)}: {error.strerror or error}") from None


def refused_ready_file(path: str | os.PathLike) -> str | None:
    """Why a `--ready-file` cannot be written, as found before the process starts anything: a link is at `path`
    (planted, it would have the file written elsewhere; write_ready_file refuses it), else None."""
    if Path(path).is_symlink():
        return (f"{os.fspath(path)} is a symbolic link; a ready file is written where it is named, never through or "
                "over a link: remove the link or name another path")
    return None


class StopRequested(BaseException):
    """SIGINT/SIGTERM arrived before the event loop ran (while importing, say); BaseException like
    KeyboardInterrupt, so no `except Exception` on the way swallows it."""


_deadline_lock = threading.Lock()
_deadline_timer: threading.Timer | None = None
_deadline_due = 0.0  # time.monotonic() when it fires


def start_stop_deadline(seconds: float | None = None) -> None:
    """Exit the process (STOP_EXIT_CODE) `seconds` from now unless it has ended by then; idempotent.

    The shutdown a process does itself (withdraw, drain, flush) is bounded by its own timeouts; this is the
    bound on everything else: a worker thread still loading weights keeps an interpreter from exiting.
    """
    with _deadline_lock:
        if _deadline_timer is None:
            _arm_deadline(stop_deadline_s if seconds is None else seconds)


def restart_stop_deadline(wait_s: float = 0.0, *, only_sooner: bool = False) -> None:
    """Once a stop is requested (its deadline started), put the deadline stop_deadline_s after `wait_s` from now
    (`only_sooner`: unless it is due sooner already): later while a shard drains its calls (`wait_s`, its own bound),
    sooner at a second signal. Nothing before a stop."""
    with _deadline_lock:
        seconds = wait_s + stop_deadline_s
        if _deadline_timer is None or (only_sooner and time.monotonic() + seconds >= _deadline_due):
            return
        _deadline_timer.cancel()
        _arm_deadline(seconds)


def _arm_deadline(seconds: float) -> None:
    """Exit the process `seconds` from now (the caller holds _deadline_lock)."""
    global _deadline_timer, _deadline_due
    _deadline_timer, _deadline_due = threading.Timer(seconds, _exit_now), time.monotonic() + seconds
    _deadline_timer.daemon = True
    _deadline_timer.start()


def stop_requested() -> bool:
    """True once SIGINT/SIGTERM asked this process to stop."""
    return _deadline_timer is not None


def end_stopped_process() -> NoReturn:
    """After a requested stop's own shutdown: run the atexit handlers, flush, exit with STOP_EXIT_CODE.

    This skips the interpreter's teardown of every loaded module (slow once torch and transformers are imported)
    and the join of a worker thread still loading weights nobody needs.
    """
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # logging's flush, temporary directories
    _exit_now()


def _exit_now() -> NoReturn:
    # The deadline ends the process without its exit handlers: its scratch folders would stay behind.
    with contextlib.suppress(Exception):
        remove_live_scratch_folders()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(STOP_EXIT_CODE)


def _raise_stop(signum: int, frame: object) -> None:
    start_stop_deadline()
    raise StopRequested(signum)


def raise_on_stop_signals() -> None:
    """From now on SIGINT/SIGTERM raise StopRequested in the main thread (and start the stop deadline)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stop)


def default_stop_signals() -> None:
    """SIGINT raises KeyboardInterrupt again and SIGTERM ends the process, as in any Python program."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Inside: SIGINT/SIGTERM raise StopRequested in the main thread (and start the stop deadline), so a
    stop during imports or set-up ends the command at once; the handlers from before are back after it."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    raise_on_stop_signals()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


@contextlib.contextmanager
def _loop_signal_handlers(loop: asyncio.AbstractEventLoop, handler: Callable[..., None], *args: Any) -> Iterator[None]:
    """`handler(*args, signum)` for SIGINT/SIGTERM while inside; the Python-level handlers from before after."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, handler, *args, signum)
    try:
        yield
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
            if previous[signum] is not None:
                signal.signal(signum, previous[signum])


class StopEvent(asyncio.Event):
    """The stop of a process run by run_until_stopped: set by the first SIGINT/SIGTERM; `again` is set by a later one,
    which asks for the stop at once (a draining shard closes what it still serves)."""

    def __init__(self) -> None:
        super().__init__()
        self.again = asyncio.Event()


def stop_again_event(stop_event: asyncio.Event) -> asyncio.Event:
    """What a second signal sets: `stop_event.again` for a StopEvent, else an event never set (a stop set in-process,
    by a test or a caller of its own, has no second signal)."""
    return stop_event.again if isinstance(stop_event, StopEvent) else asyncio.Event()


async def event_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` is set within `timeout_s`. Not asyncio.wait_for: on Python 3.11 one whose wait is over in the
    very turn a cancellation lands swallows it, and the task being stopped goes on (its stop waits for ever)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


def owned_task(tasks: set[asyncio.Task], coroutine: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task:
    """`coroutine` as a task held in `tasks` until it ends (whoever stops cancels what is there); an exception it ends
    with is logged here (its type and traceback), not left to asyncio's 'Task exception was never retrieved' once the
    task is collected."""
    task = asyncio.create_task(coroutine, name=name)
    tasks.add(task)
    task.add_done_callback(functools.partial(_forget_task, tasks))
    return task


def _forget_task(tasks: set[asyncio.Task], task: asyncio.Task) -> None:
    tasks.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        log_failure(log, task.get_name(), error)


def log_failure(logger: logging.Logger, what: str, error: BaseException, level: int = logging.ERROR) -> None:
    """Log that `what` failed with `error`, by its type and where it was raised: never its message, which may quote a
    request's prompt or a step's activations."""
    logger.log(level, "%s failed: %s raised at\n%s", what, type(error).__name__,
               "".join(traceback.format_tb(error.__traceback__)).rstrip())


class Stopped(Exception):
    """The stop event was set while `unless_stopped` waited: the command ends without serving."""


# How long an abandoned start-up step (a connect, say) may take to wind down once cancelled.
abandon_timeout_s = 1.0


async def unless_stopped(awaitable: Awaitable[T], stop_event: asyncio.Event) -> T:
    """Await a start-up step (connecting, loading a model) unless `stop_event` is set first: then cancel it
    and raise Stopped, which run_until_stopped turns into a normal stop.

    A step running on a worker thread goes on there until it finishes; the stop deadline ends the process.
    """
    step = asyncio.ensure_future(awaitable)
    stop_wait = asyncio.ensure_future(stop_event.wait())
    try:
        # No timeout of its own: the step has its own (connect_timeout_s) or is meant to take its time.
        await asyncio.wait({step, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        if not step.done():
            step.cancel()
            await asyncio.wait({step}, timeout=abandon_timeout_s)
    if step.done() and not step.cancelled():
        return step.result()
    raise Stopped("stopped while starting")


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[T]]) -> T | None:
    """Run `main(stop_event)` (run_event_loop) until it returns; None after a requested stop.

    SIGINT/SIGTERM set the event (a StopEvent) and start the stop deadline; `main` does its own shutdown, and wraps
    its start-up steps in `unless_stopped` so that a stop before it serves ends it as well. A later signal sets the
    event's `again` and puts the deadline stop_deadline_s from then (a shard that drains its calls past the first
    deadline, restart_stop_deadline, stops draining).
    """

    async def runner() -> T | None:
        stop_event = StopEvent()

        def stop(signum: int) -> None:
            if stop_event.is_set():
                stop_event.again.set()
                restart_stop_deadline(only_sooner=True)
                return
            start_stop_deadline()
            stop_event.set()

        with _loop_signal_handlers(asyncio.get_running_loop(), stop):
            try:
                return await main(stop_event)
            except Stopped:
                return None

    return run_event_loop(runner())


class Interrupted(Exception):
    """The command was stopped by SIGINT/SIGTERM before it finished."""


def run_cancelling_on_signal(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` (run_event_loop); SIGINT/SIGTERM cancel it (its `finally` runs) and raise Interrupted."""

    async def runner() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(coroutine)
        signalled: list[int] = []
        repeat: list[asyncio.TimerHandle] = []  # the next cancellation, once a signal came

        def cancel_until_done() -> None:
            # A cancellation can be lost on the way (events.cancellation): it is sent again until the task ends.
            if not task.done():
                task.cancel()
                repeat[:] = [loop.call_later(stop_repeat_s, cancel_until_done)]

        def cancel(signum: int) -> None:
            signalled.append(signum)
            cancel_until_done()

        with _loop_signal_handlers(loop, cancel):
            try:
                return await task
            except asyncio.CancelledError:
                if signalled:
                    raise Interrupted(f"stopped by signal {signalled[0]}") from None
                raise
            finally:
                for handle in repeat:
                    handle.cancel()

    return run_event_loop(runner())

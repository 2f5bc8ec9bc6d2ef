"""Runs a command's async main until SIGINT/SIGTERM, so every hearth process shuts down the same clean way."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# libuv's event loop (uvloop) is used where it is installed: every activation frame crosses two event loops
# per hop, and uvloop cuts a back-to-back NATS round trip on loopback from ~0.39 to ~0.26 ms on the project's
# 2-core VM (less after an idle gap; BENCHMARKS.md, "Compute thread and OpenMP spinning").
# HEARTH_ASYNCIO_LOOP=asyncio picks the stdlib loop.
EVENT_LOOP_ENV = "HEARTH_ASYNCIO_LOOP"


def run_event_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """asyncio.run with uvloop's loop when available (and not switched off by HEARTH_ASYNCIO_LOOP=asyncio)."""
    if os.environ.get(EVENT_LOOP_ENV, "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:  # not on this platform (uvloop has no Windows build): the stdlib loop is fine
            pass
        else:
            return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run `main(stop_event)` (run_event_loop); SIGINT/SIGTERM set the event; `main` does its own shutdown."""

    async def runner() -> T:
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop_event.set)
        try:
            return await main(stop_event)
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    return run_event_loop(runner())


class Interrupted(Exception):
    """The command was stopped by SIGINT/SIGTERM before it finished."""


def run_cancelling_on_signal(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` (run_event_loop); SIGINT/SIGTERM cancel it (its `finally` runs) and raise Interrupted."""

    async def runner() -> T:
        task = asyncio.ensure_future(coroutine)
        loop = asyncio.get_running_loop()
        signalled: list[int] = []

        def cancel(signum: int) -> None:
            signalled.append(signum)
            task.cancel()

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, cancel, signum)
        try:
            return await task
        except asyncio.CancelledError:
            if signalled:
                raise Interrupted(f"stopped by signal {signalled[0]}") from None
            raise
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    return run_event_loop(runner())

"""Runs a command's async main until SIGINT/SIGTERM, so every hearth process shuts down the same clean way."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """asyncio.run `main(stop_event)`; SIGINT/SIGTERM set the event, and `main` finishes its own shutdown."""

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

    return asyncio.run(runner())


class Interrupted(Exception):
    """The command was stopped by SIGINT/SIGTERM before it finished."""


def run_cancelling_on_signal(coroutine: Coroutine[Any, Any, T]) -> T:
    """asyncio.run `coroutine`; SIGINT/SIGTERM cancel it (its `finally` blocks run) and raise Interrupted."""

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

    return asyncio.run(runner())

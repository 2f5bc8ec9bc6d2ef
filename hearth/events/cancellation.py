"""Awaiting a nats-py request so that a cancellation landing in the turn its reply arrives is not lost."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def keeping_cancellation(awaitable: Awaitable[T], *,
                               release: Callable[[T], Awaitable[object]] | None = None) -> T:
    """The result of `awaitable`; CancelledError instead when this task was cancelled while it ran, after
    `release` (when given) was awaited on the result nobody will hold (a connection just made, to close).

    nats-py waits for its replies with asyncio.wait_for, which on Python 3.11 returns a reply that arrives in the
    turn a cancellation lands and drops the cancellation: a loop stopped there would go on for ever.
    """
    task = asyncio.current_task()
    cancels_before = task.cancelling() if task is not None else 0
    try:
        result = await awaitable
    except asyncio.CancelledError:
        raise
    except BaseException:
        if task is not None and task.cancelling() > cancels_before:
            raise asyncio.CancelledError from None
        raise
    if task is not None and task.cancelling() > cancels_before:
        if release is not None:
            await release(result)
        raise asyncio.CancelledError
    return result

"""A stream reader stopped (cancelled) in the very turn a message reaches it stops: Python 3.11's asyncio.wait_for
would hand it the message and drop the cancellation, so `hearth-replay events --follow` went on after a SIGTERM."""

from __future__ import annotations

import asyncio

import pytest

from hearth.events.ordered_reader import OrderedPushReader


async def test_a_cancellation_landing_with_a_message_is_not_dropped():
    reader = object.__new__(OrderedPushReader)  # only its queue is read on this path
    reader._queue = asyncio.Queue()
    waiting = asyncio.create_task(reader._wait_for_message())
    await asyncio.sleep(0)  # it waits on the queue now
    reader._queue.put_nowait((1, "message"))  # wakes the queue's getter ...
    waiting.cancel()  # ... and the stop lands in the same turn
    with pytest.raises(asyncio.CancelledError):
        await waiting

"""A stream reader stopped (cancelled) in the very turn a message reaches it stops: Python 3.11's asyncio.wait_for
would hand it the message and drop the cancellation, so `hearth-replay events --follow` went on after a SIGTERM. A
quiet reader waits for its next message, woken by its connection's reconnect rather than looking for one."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from hearth.events.cancellation import keeping_cancellation
from hearth.events.ordered_reader import OrderedPushReader
from hearth.events.reconnect_notices import listen_for_reconnects, tells_reconnects, told_reconnected


class _Connection:
    """What a reader reads of its connection while quiet: the reconnect count, each look at it counted."""

    def __init__(self) -> None:
        self.reconnects = 0
        self.looks = 0

    @property
    def stats(self) -> dict[str, int]:
        self.looks += 1
        return {"reconnects": self.reconnects}


def _quiet_reader(nc: _Connection | None = None) -> OrderedPushReader:
    reader = object.__new__(OrderedPushReader)  # only what a quiet follow reads
    reader._queue = asyncio.Queue()
    reader._stream = "EVENTS"
    reader._follow = True
    reader._nothing_left = False
    reader._generation = 1
    reader._last_activity = reader._waiting_since = time.monotonic()
    reader._nc = nc or _Connection()
    reader._reconnects_at_creation = 0
    reader._reconnects_told = listen_for_reconnects(reader._nc, reader._wake_on_reconnect)
    return reader


async def test_a_cancellation_landing_with_a_message_is_not_dropped():
    reader = _quiet_reader()
    waiting = asyncio.create_task(reader._wait_for_message())
    await asyncio.sleep(0)  # it waits on the queue now
    reader._queue.put_nowait((1, "message"))  # wakes the queue's getter ...
    waiting.cancel()  # ... and the stop lands in the same turn
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def _reply_swallowing_the_cancellation(reply: asyncio.Future, answer: object = "reply"):
    """What nats-py's request does on Python 3.11 when its reply and a cancellation land in the same turn: it returns
    the reply, and the cancellation is gone."""
    try:
        return await reply
    except asyncio.CancelledError:
        return answer


async def test_a_cancellation_a_nats_request_drops_is_raised_once_it_returns():
    reply = asyncio.get_running_loop().create_future()
    bare = asyncio.create_task(_reply_swallowing_the_cancellation(reply))
    kept = asyncio.create_task(keeping_cancellation(_reply_swallowing_the_cancellation(reply)))
    await asyncio.sleep(0)
    bare.cancel()
    kept.cancel()

    assert await bare == "reply"  # what the reader saw before: it carried on
    with pytest.raises(asyncio.CancelledError):
        await kept


async def test_a_timeout_a_nats_request_drops_is_a_timeout_and_a_clean_up_in_a_cancelled_task_runs():
    reply = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await keeping_cancellation(_reply_swallowing_the_cancellation(reply))

    async def cancelled_then_cleaning_up() -> str:
        try:
            await asyncio.sleep(30)
        finally:  # a cancellation from before the clean-up's request is not this request's to raise
            answered = asyncio.get_running_loop().create_future()
            answered.set_result("deleted")
            return await keeping_cancellation(answered)  # noqa: B012

    task = asyncio.create_task(cancelled_then_cleaning_up())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "deleted"


async def test_a_reader_cancelled_as_its_consumer_is_made_stops():
    reply = asyncio.get_running_loop().create_future()

    class Subscription:
        async def unsubscribe(self) -> None:
            pass

    class Connection:
        stats = {"reconnects": 0}
        is_closed = False

        def new_inbox(self) -> str:
            return "_INBOX.test"

        async def subscribe(self, subject, cb):
            return Subscription()

    class JetStream:
        _nc = Connection()

        async def add_consumer(self, stream, config, timeout):
            return await _reply_swallowing_the_cancellation(reply, SimpleNamespace(name="c-1", num_pending=0))

    reader = OrderedPushReader(JetStream(), "S", start_seq=1, start_time=None, filters=[], follow=True,
                               idle_timeout_s=5)
    making = asyncio.create_task(reader.open())  # a follow retries a failed creation for as long as it takes
    await asyncio.sleep(0)
    making.cancel()
    with pytest.raises(asyncio.CancelledError):
        await making


async def test_a_quiet_reader_waits_for_a_reconnect_to_be_told_instead_of_looking_for_one():
    nc = _Connection()
    tells_reconnects(nc)
    reader = _quiet_reader(nc)
    resets: list[int] = []

    async def reset() -> None:
        resets.append(nc.reconnects)
        reader._reconnects_at_creation = nc.reconnects

    reader._reset = reset
    reading = asyncio.create_task(reader.next_data_message())
    try:
        await asyncio.sleep(1.2)  # a look every 0.5 s, had it looked
        assert nc.looks == 0 and not resets
        nc.reconnects = 1
        told_reconnected(nc)
        async with asyncio.timeout(5):
            while not resets:
                await asyncio.sleep(0.01)
        assert resets == [1]
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)


async def test_a_reader_of_a_connection_that_tells_nothing_still_looks_for_reconnects():
    reader = _quiet_reader()  # its connection was never registered as telling
    assert not reader._reconnects_told
    resets: list[int] = []

    async def reset() -> None:
        resets.append(1)
        reader._reconnects_at_creation = reader._nc.reconnects

    reader._reset = reset
    reading = asyncio.create_task(reader.next_data_message())
    try:
        reader._nc.reconnects = 1
        async with asyncio.timeout(5):
            while not resets:
                await asyncio.sleep(0.01)
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)

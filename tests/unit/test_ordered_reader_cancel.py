"""A stream reader stopped (cancelled) in the very turn a message reaches it stops: Python 3.11's asyncio.wait_for
would hand it the message and drop the cancellation, so `hearth-replay events --follow` went on after a SIGTERM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hearth.events.cancellation import keeping_cancellation
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

"""The event outbox and publish_event against a real nats-server: an event whose write was stored with its ack lost,
and retried past the stream's duplicate window, is stored once, and so is one stored by a process that ended before
it removed the event from its outbox file, written again by the next process past the window; a publish given up on
while the broker was away is not sent when it returns."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import pytest

import hearth.events.outbox
import hearth.events.streams
from hearth.events.consume import StoredEvent, read_stream
from hearth.events.models import PipelineCompleted
from hearth.events.outbox import EventOutbox
from hearth.events.outbox_file import OutboxFile
from hearth.events.publish import publish_event
from hearth.events.streams import PIPELINES_STREAM
from tests.event_streams import jetstream_with_streams

pytestmark = pytest.mark.integration

short_duplicate_window_s = 1.0


class AckLostThenBrokerAway:
    """A JetStream context whose first publish is stored but its ack lost (the broker went down right after storing),
    and whose publishes then fail until `away_s` later (the broker is down longer than the duplicate window)."""

    def __init__(self, js, *, away_s: float) -> None:
        self._js = js
        self._away_s = away_s
        self._first_at: float | None = None

    def __getattr__(self, name):
        return getattr(self._js, name)

    async def publish(self, *args, **kwargs):
        if self._first_at is None:
            self._first_at = time.monotonic()
            await self._js.publish(*args, **kwargs)
            raise nats.errors.TimeoutError
        if time.monotonic() - self._first_at < self._away_s:
            raise nats.errors.NoRespondersError
        return await self._js.publish(*args, **kwargs)


@pytest.fixture
async def js(nats_url, monkeypatch):
    # The 120 s window and the outbox's horizon shrunk alike, so the test takes seconds.
    monkeypatch.setattr(hearth.events.streams, "duplicate_window_s", short_duplicate_window_s)
    monkeypatch.setattr(hearth.events.outbox, "unchecked_retry_horizon_s", short_duplicate_window_s / 2)
    async with jetstream_with_streams(nats_url, "test-outbox-dedup") as jetstream:
        yield jetstream


async def test_an_event_stored_with_its_ack_lost_and_retried_past_the_duplicate_window_is_stored_once(js):
    event = completed("p-ack-lost")
    outbox = EventOutbox(AckLostThenBrokerAway(js, away_s=3 * short_duplicate_window_s), max_queued=4,
                         retry_wait_s=0.2)
    outbox.start()
    try:
        await outbox.record(event)
        assert await outbox.flush(timeout_s=30)
    finally:
        await outbox.stop(timeout_s=1)

    async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM)) as items:
        stored = [item.event.event_id async for item in items if isinstance(item, StoredEvent)]
    assert stored == [event.event_id]


class StoredThenGone:
    """A JetStream context whose publishes are stored and never answered: its process ends between storing an event
    and removing it from the outbox file."""

    def __init__(self, js) -> None:
        self._js = js

    def __getattr__(self, name):
        return getattr(self._js, name)

    async def publish(self, *args, **kwargs):
        await self._js.publish(*args, **kwargs)
        await asyncio.Event().wait()


async def test_an_event_stored_by_a_process_that_ended_before_removing_it_is_stored_once(js, tmp_path):
    event = completed("p-stored-then-gone")
    ended = EventOutbox(StoredThenGone(js), max_queued=4, retry_wait_s=0.2)
    ended.start(OutboxFile.claim(tmp_path, "orch"))
    await ended.record(event)
    assert not await ended.flush(timeout_s=0.5)
    await ended.stop(timeout_s=0)  # what a kill leaves: the event stored, and still in the file
    await asyncio.sleep(2 * short_duplicate_window_s)  # the server would keep a re-publish now

    restarted = EventOutbox(js, max_queued=4, retry_wait_s=0.2)
    restarted.start(OutboxFile.claim(tmp_path, "orch"))
    try:
        assert restarted.depth == 1
        assert await restarted.flush(timeout_s=30)
    finally:
        await restarted.stop(timeout_s=1)

    async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM)) as items:
        stored = [item.event.event_id async for item in items if isinstance(item, StoredEvent)]
    assert stored == [event.event_id]


async def test_a_publish_that_failed_while_the_broker_was_away_is_not_sent_when_it_returns(nats_server, js):
    """What publish_event gave up on stays unsent: a request held by the reconnecting connection would go out at the
    reconnect, after the duplicate window when the outage is long, and store a copy the outbox's check came too late
    to see."""
    given_up = completed("p-given-up")
    await asyncio.to_thread(nats_server.stop)
    with pytest.raises((nats.errors.ConnectionReconnectingError, nats.errors.TimeoutError)):
        await publish_event(js, given_up, timeout_s=0.2, max_attempts=3)
    await asyncio.to_thread(nats_server.start)
    later = completed("p-later")

    await publish_event(js, later, timeout_s=5.0, max_attempts=20)

    async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM)) as items:
        stored = [item.event.event_id async for item in items if isinstance(item, StoredEvent)]
    assert stored == [later.event_id]


def completed(pipeline_id: str) -> PipelineCompleted:
    return PipelineCompleted(node_id="orch", pipeline_id=pipeline_id, prompt_tokens=3, completion_tokens=5,
                             duration_ms=10.0, tokens_per_second=500.0, finish_reason="stop")

"""The event outbox against a real nats-server: an event whose write was stored with its ack lost, and retried past
the stream's duplicate window, is stored once."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import pytest

import hearth.events.outbox
import hearth.events.streams
from hearth.events.consume import StoredEvent, read_stream
from hearth.events.models import PipelineCompleted, encode_event
from hearth.events.outbox import EventOutbox
from hearth.events.publish import MSG_ID_HEADER
from hearth.events.streams import PIPELINES_STREAM, ensure_streams
from hearth.protocol.subjects import event_subject
from hearth.services.broker.connection import connect_nats

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
    nc = await connect_nats(nats_url, name="test-outbox-dedup")
    jetstream = nc.jetstream()
    await ensure_streams(jetstream)
    try:
        yield jetstream
    finally:
        await nc.close()


async def test_an_event_stored_with_its_ack_lost_and_retried_past_the_duplicate_window_is_stored_once(js):
    event = PipelineCompleted(node_id="orch", pipeline_id="p-ack-lost", prompt_tokens=3, completion_tokens=5,
                              duration_ms=10.0, tokens_per_second=500.0, finish_reason="stop")
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


async def test_an_event_stored_before_a_long_broker_outage_is_not_stored_again_when_it_returns(nats_server, js):
    event = PipelineCompleted(node_id="orch", pipeline_id="p-outage", prompt_tokens=3, completion_tokens=5,
                              duration_ms=10.0, tokens_per_second=500.0, finish_reason="stop")
    await js.publish(event_subject(event), encode_event(event), headers={MSG_ID_HEADER: event.event_id})
    await asyncio.to_thread(nats_server.stop)  # stored, and the broker went down before its ack came back
    outbox = EventOutbox(js, max_queued=4, retry_wait_s=0.2)
    outbox.start()
    try:
        await outbox.record(event)
        await asyncio.sleep(3 * short_duplicate_window_s)  # writes tried while the broker is away
        await asyncio.to_thread(nats_server.start)
        assert await outbox.flush(timeout_s=30)
    finally:
        await outbox.stop(timeout_s=1)

    async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM)) as items:
        stored = [item.event.event_id async for item in items if isinstance(item, StoredEvent)]
    assert stored == [event.event_id]

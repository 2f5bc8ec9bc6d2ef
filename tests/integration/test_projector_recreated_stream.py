"""A stream deleted and created again (a broker whose store was wiped) is read again from its first message by a
projector that had passed its new sequences, whether it was running then or started afterwards
(hearth/readmodels/stream_identity.py); before, it waited silently for sequences it had already applied."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from datetime import datetime, timezone

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from hearth.events.consume import read_stream
from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, ensure_streams
from hearth.readmodels.db import open_engine
from hearth.readmodels.projection import epoch_s
from hearth.readmodels.stream_identity import StreamState, created_after, recreated_since, stream_state
from hearth.readmodels.tables import Pipeline
from hearth.services.broker.connection import connect_nats
from hearth.services.projector.main import run_projector
from tests.integration.test_projector_nats_restart import publish_all, resume_timeout_s, wait_for_metric
from tests.readmodel_helpers import synthetic_events

pytestmark = pytest.mark.integration

# A stream's creation time and a message's storage time are kept in whole seconds by the read model: the new stream
# must be created in a later second than the last message applied from the old one was stored.
beyond_the_last_second_s = 2.1


async def recreate_streams(js) -> None:
    await asyncio.sleep(beyond_the_last_second_s)
    for stream in ALL_STREAMS:
        await js.delete_stream(stream)
    await ensure_streams(js)


def pipelines_in(db_path) -> set[str]:
    engine = open_engine(db_path)
    try:
        with Session(engine) as session:
            return {pipeline.pipeline_id for pipeline in session.query(Pipeline)}
    finally:
        engine.dispose()


async def test_a_running_projector_reads_a_recreated_stream_from_its_first_message(nats_server, tmp_path):
    db_path, registry, stop = tmp_path / "rm.db", CollectorRegistry(), asyncio.Event()
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
    try:
        first = await publish_all(js, synthetic_events(pipelines=10, heartbeats_per_shard=5, seed=7))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        await recreate_streams(js)
        # Fewer messages than the projector had applied: the new stream's last sequence is below its position.
        second = await publish_all(js, synthetic_events(pipelines=2, heartbeats_per_shard=1, seed=8, t0=50.0))
        assert all(second[stream] < first[stream] for stream in second)
        await wait_for_metric(registry, "hearth_projector_position", second, resume_timeout_s)
        await wait_for_metric(registry, "hearth_projector_lag_events", {stream: 0 for stream in second},
                              resume_timeout_s)
    finally:
        stop.set()
        await asyncio.wait_for(service, timeout=15)
        await nc.close()
    assert {"p8-0", "p8-1"} <= pipelines_in(db_path)


async def test_a_projector_started_after_the_stream_was_recreated_and_grew_past_its_position(nats_server, tmp_path):
    db_path, registry = tmp_path / "rm.db", CollectorRegistry()
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        stop = asyncio.Event()
        service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
        first = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=7))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        stop.set()
        await asyncio.wait_for(service, timeout=15)

        await recreate_streams(js)
        # More messages than it had applied: only the message at its position, stored later, tells the streams apart.
        second = await publish_all(js, synthetic_events(pipelines=12, heartbeats_per_shard=6, seed=9, t0=50.0))
        assert all(second[stream] > first[stream] for stream in second)
        registry, stop = CollectorRegistry(), asyncio.Event()
        service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
        await wait_for_metric(registry, "hearth_projector_position", second, resume_timeout_s)
        stop.set()
        await asyncio.wait_for(service, timeout=15)
    finally:
        await nc.close()
    assert {f"p9-{index}" for index in range(12)} <= pipelines_in(db_path)


async def test_the_same_messages_under_a_later_creation_time_keep_the_position(nats_server):
    # A stream restored from a backup: created later, its messages (and their storage times) the same.
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        last = await publish_all(js, synthetic_events(pipelines=2, heartbeats_per_shard=1, seed=7))
        position = last[PIPELINES_STREAM]
        stored = await stream_state(js, PIPELINES_STREAM)
        async with aclosing(read_stream(js, PIPELINES_STREAM, from_seq=position)) as reading:
            applied_at = epoch_s((await anext(reading)).time)
        restored = StreamState(created=datetime.fromtimestamp(applied_at + 60, timezone.utc), last_seq=stored.last_seq)
        assert created_after(restored, applied_at)
        assert await recreated_since(js, PIPELINES_STREAM, restored, position, applied_at) is None
        why = await recreated_since(js, PIPELINES_STREAM, restored, position, applied_at - 5)
        assert why is not None and f"its message {position} is another one" in why
        # The stream as it is: created before what was applied from it, so nothing more is read.
        assert not created_after(stored, applied_at)
        assert await recreated_since(js, PIPELINES_STREAM, stored, position, applied_at) is None
    finally:
        await nc.close()

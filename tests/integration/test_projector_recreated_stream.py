"""A stream deleted and created again (a broker whose store was wiped) is read again from its first message by a
projector whose position it had passed, whether it was running then or started afterwards, however soon after its
last event it was created again and however far it grew (hearth/readmodels/stream_identity.py); before, the
projector waited silently for sequences it had already applied. Resumes never leave followers behind."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from hearth.events.consume import read_stream
from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, ensure_streams
from hearth.readmodels.db import open_engine
from hearth.readmodels.projection import epoch_s
from hearth.readmodels.runner import Projector
from hearth.readmodels.stream_identity import StreamState, judge, stream_state
from hearth.readmodels.tables import Pipeline
from hearth.services.broker.connection import connect_nats
from hearth.services.projector.main import run_projector
from tests.integration.test_projector_nats_restart import publish_all, resume_timeout_s, wait_for_metric
from tests.readmodel_helpers import synthetic_events

pytestmark = pytest.mark.integration


async def recreate_streams(js) -> None:
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


@pytest.mark.parametrize(("pipelines", "heartbeats"), [(2, 1), (12, 6)], ids=["fewer-messages", "more-messages"])
async def test_a_running_projector_reads_a_stream_created_again_at_once_from_its_first_message(
        nats_server, tmp_path, pipelines, heartbeats):
    db_path, registry, stop = tmp_path / "rm.db", CollectorRegistry(), asyncio.Event()
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
    try:
        first = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=7))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        await asyncio.sleep(1.5)  # a lag poll records each stream's creation time
        # Created again within the second of the last event, and filled at once: fewer messages than the
        # position, or more (then only the message at the position tells the streams apart).
        await recreate_streams(js)
        second = await publish_all(js, synthetic_events(pipelines=pipelines, heartbeats_per_shard=heartbeats,
                                                        seed=8, t0=50.0))
        await wait_for_metric(registry, "hearth_projector_position", second, resume_timeout_s)
        await wait_for_metric(registry, "hearth_projector_lag_events", {stream: 0 for stream in second},
                              resume_timeout_s)
    finally:
        stop.set()
        await asyncio.wait_for(service, timeout=15)
        await nc.close()
    assert {f"p8-{index}" for index in range(pipelines)} <= pipelines_in(db_path)


async def test_a_projector_started_after_the_stream_was_created_again_and_grew_past_its_position(
        nats_server, tmp_path):
    db_path, registry = tmp_path / "rm.db", CollectorRegistry()
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        stop = asyncio.Event()
        service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
        first = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=7))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        await asyncio.sleep(1.5)  # a lag poll records each stream's creation time
        stop.set()
        await asyncio.wait_for(service, timeout=15)

        await recreate_streams(js)
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


async def test_the_same_messages_under_another_creation_time_keep_the_position(nats_server):
    # A stream restored from a backup: created later, its messages (and their storage times) the same.
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        position = (await publish_all(js, synthetic_events(pipelines=2, heartbeats_per_shard=1, seed=7)))[
            PIPELINES_STREAM]
        now = await stream_state(js, PIPELINES_STREAM)
        recorded = "2020-01-01T00:00:00+00:00"  # the creation time the position recorded, before the restore
        async with aclosing(read_stream(js, PIPELINES_STREAM, from_seq=position, to_seq=position)) as reading:
            applied_at = epoch_s((await anext(reading)).time)

        async def verdict(state: StreamState, last_event_at: int | None, recorded_created: str | None = recorded):
            return await judge(js, PIPELINES_STREAM, state, position=position, recorded=recorded_created,
                               last_event_at=last_event_at)

        assert await verdict(now, applied_at) == "restored"
        assert await verdict(now, applied_at - 5) == "recreated"  # another message at the position
        assert await verdict(StreamState(now.created, position - 1), applied_at) == "recreated"
        assert await verdict(now, applied_at, now.created) == "its_own"
        assert await verdict(now, applied_at, None) == "unrecorded"
    finally:
        await nc.close()


async def test_resumes_at_the_same_time_leave_one_follower_per_stream(nats_server, tmp_path):
    nc = await connect_nats(nats_server.url, name="test-projector")
    try:
        async with Projector(tmp_path / "rm.db", nc.jetstream()) as projector:
            await asyncio.gather(projector._resume_from_database(), projector._resume_from_database())
            following = [task for task in asyncio.all_tasks() if task.get_name().startswith("projector-follow-")
                         and not task.done()]
            assert len(following) == len(ALL_STREAMS)
        await asyncio.sleep(0)
        assert not [task for task in asyncio.all_tasks() if task.get_name().startswith("projector-follow-")
                    and not task.done()]
    finally:
        await nc.close()

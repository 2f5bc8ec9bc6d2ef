"""A stream deleted and created again (a broker whose store was wiped) is told from the one a projector's position was
taken in by its creation time, and said loudly (an error, `hearth_projector_stream_replaced`), whether the projector
ran then or started afterwards, while updates and restarts of the same stream are not (hearth/readmodels/
stream_identity.py); before, the projector waited in silence for sequences it had already applied. Resumes never
leave followers behind."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from hearth.events.streams import ALL_STREAMS, ensure_streams
from hearth.readmodels import runner
from hearth.readmodels.runner import Projector
from hearth.services.broker.connection import connect_nats
from hearth.services.projector.main import run_projector
from tests.integration.test_projector_nats_restart import metric, publish_all, resume_timeout_s, wait_for_metric
from tests.readmodel_helpers import synthetic_events

pytestmark = pytest.mark.integration
REPLACED = "hearth_projector_stream_replaced"


async def recreate_streams(js) -> None:
    for stream in ALL_STREAMS:
        await js.delete_stream(stream)
    await ensure_streams(js)


async def test_a_stream_created_again_under_a_running_projector_is_said_and_its_restarts_are_not(
        nats_server, tmp_path, caplog):
    db_path, registry, stop = tmp_path / "rm.db", CollectorRegistry(), asyncio.Event()
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
    try:
        first = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=7))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        await asyncio.sleep(1.5)  # the poll as a position first moves records each stream's creation time
        # The same streams updated, and the server restarted: nothing to say.
        await ensure_streams(js, replicas=1)
        await asyncio.to_thread(nats_server.restart)
        second = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=8, t0=50.0))
        await wait_for_metric(registry, "hearth_projector_position", second, resume_timeout_s)
        assert {stream: metric(registry, REPLACED, stream) for stream in ALL_STREAMS} == dict.fromkeys(ALL_STREAMS, 0)

        with caplog.at_level(logging.ERROR, logger="hearth.readmodels.stream_identity"):
            await recreate_streams(js)
            await wait_for_metric(registry, REPLACED, dict.fromkeys(ALL_STREAMS, 1), resume_timeout_s)
        assert "rebuild it" in caplog.text and "deleted and created again" in caplog.text
    finally:
        stop.set()
        await asyncio.wait_for(service, timeout=15)
        await nc.close()


async def test_a_projector_started_after_its_stream_was_created_again_says_so(nats_server, tmp_path):
    db_path, registry = tmp_path / "rm.db", CollectorRegistry()
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        stop = asyncio.Event()
        service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
        first = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=7))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        await asyncio.sleep(1.5)  # the poll as a position first moves records each stream's creation time
        stop.set()
        await asyncio.wait_for(service, timeout=15)

        await recreate_streams(js)
        await publish_all(js, synthetic_events(pipelines=12, heartbeats_per_shard=6, seed=9, t0=50.0))
        registry, stop = CollectorRegistry(), asyncio.Event()
        service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
        await wait_for_metric(registry, REPLACED, dict.fromkeys(ALL_STREAMS, 1), resume_timeout_s)
        stop.set()
        await asyncio.wait_for(service, timeout=15)
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


async def test_a_stream_created_again_before_a_fresh_read_models_first_poll_is_said(nats_server, tmp_path, monkeypatch):
    """A fresh read model's position is taken in the stream as it was when the projector started reading it, not
    in whatever stream of that name its first poll after applying finds."""
    monkeypatch.setattr(runner, "lag_poll_interval_s", 3600.0)  # only the polls this test makes
    nc = await connect_nats(nats_server.url, name="test-projector")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        async with Projector(tmp_path / "rm.db", js) as projector:
            last = await publish_all(js, synthetic_events(pipelines=3, heartbeats_per_shard=2, seed=7))
            for stream, seq in last.items():
                await projector.wait_for_position(stream, seq, resume_timeout_s)
            await recreate_streams(js)
            for stream in last:
                await projector._check_stream(stream)
            assert set(projector.replaced_streams) == set(last)
    finally:
        await nc.close()

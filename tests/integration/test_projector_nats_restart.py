"""The projector service survives a nats-server restart and applies what is published afterwards; it exports
lag and applied counters."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from hearth.events.publish import publish_event
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM, ensure_streams
from hearth.readmodels.db import open_engine
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.tables import Pipeline
from hearth.services.broker.connection import connect_nats
from hearth.services.projector.main import run_projector
from tests.readmodel_helpers import synthetic_events

pytestmark = pytest.mark.integration

# The reader notices a vanished consumer after ~3 missed idle heartbeats (2 s each), then recreates it.
resume_timeout_s = 30.0


def metric(registry: CollectorRegistry, name: str, stream: str) -> float | None:
    return registry.get_sample_value(name, {"projection": "readmodels", "stream": stream})


async def wait_for_metric(registry, name: str, expected: dict[str, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(metric(registry, name, stream) == value for stream, value in expected.items()):
            return
        await asyncio.sleep(0.05)
    actual = {stream: metric(registry, name, stream) for stream in expected}
    raise AssertionError(f"{name} is {actual}, expected {expected}")


async def assert_same_as_a_rebuild(js, db_path, tmp_path) -> None:
    """Nothing lost, nothing applied twice: the live rows equal those rebuilt from the log."""
    rebuilt = tmp_path / "rebuilt.db"
    await rebuild_database(js, rebuilt)
    assert [str(d) for d in diff_databases(rebuilt, db_path, include_positions=True)] == []


async def publish_all(js, events) -> dict[str, int]:
    last: dict[str, int] = {}
    for event in events:
        ack = await publish_event(js, event)
        last[ack.stream] = ack.seq
    return last


async def test_projector_resumes_after_the_nats_server_restarts(nats_server, tmp_path):
    registry = CollectorRegistry()
    db_path = tmp_path / "rm.db"
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    before = synthetic_events(pipelines=10, heartbeats_per_shard=5, seed=7)
    after = synthetic_events(pipelines=10, heartbeats_per_shard=5, seed=8, t0=50.0)
    stop = asyncio.Event()
    service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
    try:
        first = await publish_all(js, before)
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)
        assert metric(registry, "hearth_projector_applied_events_total", SHARDS_STREAM) == first[SHARDS_STREAM]
        by_type = {event.type: 0 for event in before}
        for event in before:
            by_type[event.type] += 1
        assert {event_type: registry.get_sample_value("hearth_projector_events_applied_total",
                                                      {"event_type": event_type}) for event_type in by_type} == by_type
        await wait_for_metric(registry, "hearth_projector_lag_events", {SHARDS_STREAM: 0, PIPELINES_STREAM: 0},
                              resume_timeout_s)

        await asyncio.to_thread(nats_server.restart)
        second = await publish_all(js, after)  # publish_event retries while the client reconnects
        assert second[SHARDS_STREAM] > first[SHARDS_STREAM]
        await wait_for_metric(registry, "hearth_projector_position", second, resume_timeout_s)
        await wait_for_metric(registry, "hearth_projector_lag_events", {SHARDS_STREAM: 0, PIPELINES_STREAM: 0},
                              resume_timeout_s)
        assert metric(registry, "hearth_projector_applied_events_total", PIPELINES_STREAM) == second[PIPELINES_STREAM]
        assert not service.done()
        await assert_same_as_a_rebuild(js, db_path, tmp_path)
    finally:
        stop.set()
        await asyncio.wait_for(service, timeout=15)
        await nc.close()

    engine = open_engine(db_path)
    with Session(engine) as session:
        assert session.query(Pipeline).count() == 20
        assert session.get(Pipeline, "p8-9") is not None
    engine.dispose()
    assert metric(registry, "hearth_projector_position", SHARDS_STREAM) is None  # unregistered on stop


async def test_lag_shows_a_blocked_backlog_and_a_failed_batch_is_retried(nats_server, tmp_path, monkeypatch):
    """While another writer holds the database, the backlog shows up as lag and batches fail; once it lets
    go, the projector resumes from the stored positions and applies everything exactly once."""
    monkeypatch.setattr("hearth.readmodels.db.sqlite_busy_timeout_ms", 200)
    nc = await connect_nats(nats_server.url, name="test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    db_path = tmp_path / "lag.db"
    registry = CollectorRegistry()
    stop = asyncio.Event()
    service = asyncio.create_task(run_projector(db_path, nats_server.url, stop_event=stop, registry=registry))
    try:
        first = await publish_all(js, synthetic_events(pipelines=5, heartbeats_per_shard=3, seed=9))
        await wait_for_metric(registry, "hearth_projector_position", first, resume_timeout_s)

        blocker = sqlite3.connect(db_path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            second = await publish_all(js, synthetic_events(pipelines=5, heartbeats_per_shard=3, seed=10, t0=50))
            backlog = {stream: second[stream] - first[stream] for stream in second}
            await wait_for_metric(registry, "hearth_projector_lag_events", backlog, resume_timeout_s)
            deadline = time.monotonic() + resume_timeout_s
            while not registry.get_sample_value("hearth_projector_apply_failures_total", {"projection": "readmodels"}):
                assert time.monotonic() < deadline, "no batch failed while the database was locked"
                await asyncio.sleep(0.05)
            # Read but not applied: the backlog has an age.
            while not metric(registry, "hearth_projector_lag_seconds", PIPELINES_STREAM):
                assert time.monotonic() < deadline, "no lag in seconds while the database was locked"
                await asyncio.sleep(0.05)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        await wait_for_metric(registry, "hearth_projector_position", second, resume_timeout_s)
        await wait_for_metric(registry, "hearth_projector_lag_events", {s: 0 for s in second}, resume_timeout_s)
        assert metric(registry, "hearth_projector_applied_events_total", PIPELINES_STREAM) == second[PIPELINES_STREAM]
        assert {stream: metric(registry, "hearth_projector_lag_seconds", stream) for stream in second} == \
            {stream: 0.0 for stream in second}
        await assert_same_as_a_rebuild(js, db_path, tmp_path)
    finally:
        stop.set()
        await asyncio.wait_for(service, timeout=15)
        await nc.close()
    engine = open_engine(db_path)
    with Session(engine) as session:
        assert session.query(Pipeline).count() == 10
    engine.dispose()

"""Retention of the read models: history older than the policy goes by the log's clock, state stays, a flood of
rejected events leaves a bounded sample with exact counts, and pruning now and then agrees with pruning once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from datetime import timedelta

import pytest
from alembic import command
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.models import PipelineCompleted, ShardWithdrawn
from hearth.events.streams import pipelines_max_age_s, seconds_per_day, shards_max_age_s
from hearth.readmodels.db import alembic_config, open_engine, upgrade_database
from hearth.readmodels import retention
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.retention import keep_pruning, prune_all, retention_policy
from hearth.services.common.config import ReadModelSettings
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import DASHBOARDS
from tests.readmodel_helpers import (
    T0,
    LogBuilder,
    advertised,
    apply_all,
    at,
    constructed,
    dump_rows,
    heartbeat,
    migrated_engine,
    synthetic_events,
)
from tests.reputation_events import confirmed, verified

DAY = seconds_per_day
POLICY = retention_policy(ReadModelSettings())
JUNK_NODE = "junk"


class RejectsJunk:
    """A verifier that refuses every event claiming the junk node, as a roster refuses a non-member's."""

    def rejection(self, event, *, received_at, stored_data=b"", position=None, removal_logged=False,
                      steward_succession=None, member_succession=None, member_addition=None):
        return "unknown_signer" if event.node_id == JUNK_NODE else None


def projection() -> ReadModelProjection:
    return ReadModelProjection(verifier=RejectsJunk(), retention=POLICY)


def count(engine, sql: str) -> int:
    with engine.connect() as connection:
        return connection.execute(text(sql)).scalar()


def prune(engine) -> int:
    return prune_all(sessionmaker(engine), POLICY, projection().name)


def junk(n: int, *, t: float) -> list:
    return [heartbeat(f"junk-{i}", t=t, node=JUNK_NODE) for i in range(n)]


def forty_days_of_traffic() -> list:
    """A community's log over 40 days: one traffic burst every 5 days, a flood of junk on the first day, a shard that
    left on day 1 and one quarantined on day 0 that nobody cleared, and a host alive until the end."""
    events = junk(30, t=10.0)
    for day in range(0, 41, 5):
        events += synthetic_events(seed=day, t0=day * DAY, shards=2, pipelines=6, heartbeats_per_shard=2)
    gone = advertised(0, 3, "gone", t=0.0)
    events += [gone, ShardWithdrawn(shard_id=gone.shard_id, reason="shutdown", node_id="gone", occurred_at=at(DAY))]
    bad = advertised(4, 7, "bad", t=0.0)
    events += [bad, constructed("q-1", [bad.shard_id], t=5.0), confirmed("q-1", bad.shard_id, ["w1", "w2"], t=6.0)]
    events += [verified("v-1", {"ok-shard": (3, 12)}, t=7.0)]
    alive = advertised(0, 3, "alive", t=40 * DAY, ttl_s=120.0)
    events += [alive, heartbeat(alive.shard_id, t=40 * DAY + 1, node="alive")]
    return sorted(events, key=lambda event: event.occurred_at)


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    yield engine
    engine.dispose()


def test_the_default_retention_is_each_streams_max_age():
    settings = ReadModelSettings()
    assert settings.shards_retention_days * DAY == shards_max_age_s
    assert settings.pipelines_retention_days * DAY == pipelines_max_age_s
    assert settings.daily_totals_retention_days * DAY > pipelines_max_age_s


def test_pruning_removes_old_history_and_keeps_state(engine):
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in forty_days_of_traffic()], projection())
    clock = count(engine, "SELECT last_event_at FROM projection_positions WHERE stream = 'HEARTH_PIPELINES'")
    pipelines_cutoff = clock - 30 * DAY
    assert count(engine, f"SELECT COUNT(*) FROM pipelines WHERE updated_at < {pipelines_cutoff}") > 0

    assert prune(engine) > 0

    for table, column in (("pipelines", "updated_at"), ("failovers", "occurred_at"), ("pipeline_minutes", "minute"),
                          ("event_counts", "minute"), ("rejected_events", "rejected_at"),
                          ("rejected_event_counts", "minute")):
        assert count(engine, f"SELECT COUNT(*) FROM {table} WHERE {column} < {pipelines_cutoff - 60}") == 0, table
    assert count(engine, "SELECT COUNT(*) FROM pipelines") > 0  # the last 30 days' calls stay
    # A shard that left long ago goes with its heartbeats; the live one stays whatever its advert's age.
    shards = {row[0] for row in Session(engine).execute(text("SELECT node_id FROM shards"))}
    assert "gone" not in shards and "alive" in shards
    assert count(engine, "SELECT COUNT(*) FROM shard_health WHERE shard_id NOT IN (SELECT shard_id FROM shards)") == 0
    # A quarantine in force stays with its evidence; a reputation nothing touched for 30 days goes.
    assert count(engine, "SELECT COUNT(*) FROM shard_reputation WHERE status = 'quarantined'") == 1
    assert count(engine, "SELECT COUNT(*) FROM integrity_evidence") == 1
    assert count(engine, "SELECT COUNT(*) FROM shard_reputation WHERE shard_id = 'ok-shard'") == 0
    # Daily totals outlive the calls they sum.
    assert count(engine, "SELECT MIN(day) FROM host_tokens_daily") < pipelines_cutoff
    assert prune(engine) == 0  # nothing is left to prune


def test_pruning_goes_by_the_logs_clock_not_this_machines(engine):
    """Forty days of history read in one go (a projector that was off for a month): nothing goes until the log's
    own clock passes it, whatever today's date."""
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in synthetic_events(seed=1, shards=2, pipelines=4)], projection())
    before = dump_rows(engine)
    assert prune(engine) == 0
    assert dump_rows(engine) == before


def test_a_flood_of_rejected_events_keeps_a_bounded_sample_and_counts_every_one(engine):
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in junk(1000, t=1.0) + junk(1000, t=61.0)], projection())
    samples = POLICY.rejected_samples_per_minute
    assert count(engine, "SELECT COUNT(*) FROM rejected_events") == 2 * samples
    assert count(engine, "SELECT SUM(events) FROM rejected_event_counts") == 2000
    assert count(engine, "SELECT COUNT(*) FROM rejected_event_counts") == 2


@pytest.mark.parametrize("batch_size", [1, 7, 50])
def test_pruning_along_the_way_agrees_with_a_rebuild_pruned_at_the_end(tmp_path, batch_size):
    log = LogBuilder()
    messages = [log.stored(event) for event in forty_days_of_traffic()]
    live = migrated_engine(tmp_path / "live.db")
    rebuilt = migrated_engine(tmp_path / "rebuilt.db")
    try:
        for start in range(0, len(messages), batch_size):
            apply_all(live, messages[start:start + batch_size], projection())
            prune(live)
        apply_all(rebuilt, messages, projection())
        prune(rebuilt)
        assert dump_rows(live) == dump_rows(rebuilt)
    finally:
        live.dispose()
        rebuilt.dispose()


def test_every_dashboard_query_runs_on_a_pruned_read_model(tmp_path, engine):
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in forty_days_of_traffic()], projection())
    prune(engine)
    engine.dispose()
    end = int((T0 + timedelta(days=40)).timestamp())
    with contextlib.closing(open_read_only(tmp_path / "rm.db")) as connection:
        for panel in (panel for dashboard in DASHBOARDS for panel in dashboard.sql_panels):
            columns, _rows = run_panel_sql(connection, panel.sql, TimeRange(end - 7 * DAY, end))
            assert set(panel.columns) <= set(columns), panel.title
        _columns, rejected = run_panel_sql(connection, next(
            p.sql for d in DASHBOARDS for p in d.sql_panels if p.title == "Rejected events per minute by reason"),
            TimeRange(int(T0.timestamp()), end))
    assert rejected == []  # the junk flood of day 0 aged out with its counts


async def test_a_projector_prunes_on_its_timer_in_turns_with_the_applier(tmp_path, engine):
    log = LogBuilder()
    messages = [log.stored(event) for event in forty_days_of_traffic()]
    apply_all(engine, messages, projection())
    twin = migrated_engine(tmp_path / "twin.db")
    apply_all(twin, messages, projection())
    expected = prune(twin)
    twin.dispose()
    pruned: list[int] = []
    policy = retention_policy(ReadModelSettings(prune_interval_s=0.01, prune_batch_rows=3))
    turn = asyncio.Lock()
    task = asyncio.create_task(keep_pruning(sessionmaker(engine), policy, projection().name, turn, pruned.append))
    try:
        async with turn:  # a batch being applied: no pruning meanwhile
            await asyncio.sleep(0.05)
            assert pruned == []
        deadline = asyncio.get_running_loop().time() + 10
        while sum(pruned) < expected:
            assert asyncio.get_running_loop().time() < deadline, (sum(pruned), expected)
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert sum(pruned) == expected and max(pruned) <= 3  # in many small transactions


def test_the_migration_counts_the_rejected_events_already_held(tmp_path):
    path = tmp_path / "rm.db"
    upgrade_database(path, "0009")
    engine = open_engine(path)
    with engine.begin() as connection:
        for seq in range(3):
            connection.execute(text(
                "INSERT INTO rejected_events (stream, stream_seq, event_id, type, node_id, signer, reason, "
                f"occurred_at, rejected_at) VALUES ('HEARTH_SHARDS', {seq + 1}, 'e{seq}', 'shard.heartbeat', 'n', "
                f"NULL, 'unsigned', 120, {120 + seq})"))
    engine.dispose()
    command.upgrade(alembic_config(path), "head")
    engine = open_engine(path)
    assert count(engine, "SELECT minute || ' ' || stream || ' ' || reason || ' ' || events "
                         "FROM rejected_event_counts") == "120 HEARTH_SHARDS unsigned 3"
    engine.dispose()


def test_a_completed_call_is_counted_on_its_shards_with_the_time_it_was_counted(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "a")
    apply_all(engine, [log.stored(shard), log.stored(constructed("p", [shard.shard_id], t=5.0)),
                       log.stored(PipelineCompleted(pipeline_id="p", prompt_tokens=1, completion_tokens=1,
                                                    duration_ms=1.0, tokens_per_second=1.0, finish_reason="stop",
                                                    node_id="hub", occurred_at=at(6.0)))], projection())
    assert count(engine, "SELECT last_counted_at FROM shard_stats") == int(T0.timestamp()) + 5


async def test_a_cancelled_pruner_ends_only_once_its_transaction_has(tmp_path, engine, monkeypatch):
    """Stopping a projector cancels its pruner: the transaction under way in its thread ends first, holding the write
    turn meanwhile, so no other writer starts and the engine is not disposed under it."""
    started, finished = threading.Event(), threading.Event()

    def slow_prune(session, policy, projection):
        started.set()
        time.sleep(0.3)
        finished.set()
        return 0

    monkeypatch.setattr(retention, "prune_once", slow_prune)
    turn = asyncio.Lock()
    policy = retention_policy(ReadModelSettings(prune_interval_s=0.01))
    task = asyncio.create_task(keep_pruning(sessionmaker(engine), policy, projection().name, turn, lambda rows: None))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert finished.is_set() and not turn.locked()

"""The dashboards' sums and ages on stand-in read models: a host's tokens count each call once however many of the
call's hops it holds (and the upgrade to host_tokens_daily carries the days held over), and every age a panel shows
is measured to the end of the chosen time range, never negative when the read model already holds something newer
than that end (a past range)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path

from hearth.events.models import PipelineCompleted
from hearth.readmodels.db import upgrade_database
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import DASHBOARDS
from tests.readmodel_helpers import MODEL_ID, LogBuilder, advertised, apply_all, at, constructed, heartbeat, \
    migrated_engine

PANELS = {panel.title: panel for dashboard in DASHBOARDS for panel in dashboard.sql_panels}
DAY = 86400


def read_model(path: Path, events) -> Path:
    engine = migrated_engine(path)
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in events])
    engine.dispose()
    return path


def panel_rows(db: Path, title: str, time_range: TimeRange) -> list[dict]:
    with contextlib.closing(open_read_only(db)) as connection:
        columns, rows = run_panel_sql(connection, PANELS[title].sql, time_range)
    return [dict(zip(columns, row)) for row in rows]


def epoch(seconds: float) -> int:
    return int(at(seconds).timestamp())


def completed(pipeline_id: str, *, prompt_tokens: int, completion_tokens: int, t: float) -> PipelineCompleted:
    return PipelineCompleted(pipeline_id=pipeline_id, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             duration_ms=3.0, tokens_per_second=4.0, finish_reason="length", node_id="hub",
                             occurred_at=at(t))


def test_a_host_holding_two_hops_of_a_call_counts_its_tokens_once(tmp_path):
    # Host a serves layers 0-3 and 4-5 (two shard processes, or one serving two ranges), host b layers 6-7.
    a_low, a_mid, b_high = (advertised(0, 3, "a"), advertised(4, 5, "a"), advertised(6, 7, "b"))
    hops = [a_low.shard_id, a_mid.shard_id, b_high.shard_id]
    db = read_model(tmp_path / "rm.sqlite", [
        a_low, a_mid, b_high,
        constructed("p-1", hops, t=2), completed("p-1", prompt_tokens=5, completion_tokens=7, t=3),
        constructed("p-2", hops[:2], t=4), completed("p-2", prompt_tokens=1, completion_tokens=2, t=5),
    ])
    day = epoch(0) // DAY * DAY
    rows = panel_rows(db, "Tokens through each host per day", TimeRange(epoch(0) - 3600, epoch(10)))
    assert {(row["time"], row["host"]): row["tokens"] for row in rows} == {(day, "a"): 12 + 3, (day, "b"): 12}


def test_a_hosts_tokens_stay_under_its_name_once_its_shard_rows_are_pruned(tmp_path):
    shard = advertised(0, 7, "a")
    db = read_model(tmp_path / "rm.sqlite", [
        shard, constructed("p-1", [shard.shard_id], t=2), completed("p-1", prompt_tokens=5, completion_tokens=7, t=3),
        constructed("p-2", [f"{MODEL_ID}:0-7@unparsed-but-named", "no-node-named"], t=4),
        completed("p-2", prompt_tokens=1, completion_tokens=1, t=5),
    ])
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("DELETE FROM shards")
    rows = panel_rows(db, "Tokens through each host per day", TimeRange(epoch(0) - 3600, epoch(10)))
    assert {row["host"]: row["tokens"] for row in rows} == {"a": 12, "unparsed-but-named": 2, "no-node-named": 2}


def mesh_seen_later() -> list:
    """One shard advertised at 0 s that heartbeats until 150 s: a range ending at 40 s is in the past of its newest
    heartbeat, the only one the read model keeps (its advertisement lasts 600 s)."""
    shard = advertised(0, 7, "steady", t=0, ttl_s=600.0)
    return [shard, *(heartbeat(shard.shard_id, t=t, node="steady") for t in range(10, 151, 10))]


def test_a_heartbeat_newer_than_the_ranges_end_gives_no_negative_age(tmp_path):
    db = read_model(tmp_path / "rm.sqlite", mesh_seen_later())
    [past] = panel_rows(db, "Shards advertised", TimeRange(epoch(0), epoch(40)))
    assert past["heartbeat_age_s"] == 0, past
    [after] = panel_rows(db, "Shards advertised", TimeRange(epoch(0), epoch(160)))
    assert after["heartbeat_age_s"] == 10, after


def test_a_streams_newest_event_newer_than_the_ranges_end_gives_no_negative_age(tmp_path):
    db = read_model(tmp_path / "rm.sqlite", mesh_seen_later())
    ages = {row["stream"]: row["newest_event_age_s"]
            for row in panel_rows(db, "Projection positions", TimeRange(epoch(0), epoch(40)))}
    assert ages and set(ages.values()) == {0}, ages
    ages = {row["stream"]: row["newest_event_age_s"]
            for row in panel_rows(db, "Projection positions", TimeRange(epoch(0), epoch(160)))}
    assert set(ages.values()) == {10}, ages


def test_the_upgrade_carries_each_hosts_days_over_less_what_held_calls_counted_twice(tmp_path):
    path = tmp_path / "old.db"
    upgrade_database(path, "0017")
    a_low, a_mid, b_high = f"{MODEL_ID}:0-3@a", f"{MODEL_ID}:4-5@a", f"{MODEL_ID}:6-7@b"
    pruned_day, held_day = 10 * DAY, 11 * DAY
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        # The old projection counted each call on each of its shards: 12 tokens through a's two shards and b's.
        connection.executemany("INSERT INTO shard_tokens_daily (day, shard_id, tokens) VALUES (?, ?, ?)", [
            (pruned_day, a_low, 100), (pruned_day, a_mid, 100), (held_day, a_low, 12 + 7), (held_day, a_mid, 12),
            (held_day, b_high, 12), (held_day, "no-node-named", 7)])
        connection.executemany(
            "INSERT INTO pipelines (pipeline_id, orchestrator_node_id, status, hops, prompt_tokens, "
            "completion_tokens, failovers, fell_back_to_local, finished_at, updated_at) "
            "VALUES (?, 'hub', 'completed', ?, ?, ?, 0, 0, ?, ?)",
            [("p-1", json.dumps([a_low, a_mid, b_high]), 5, 7, held_day + 5, held_day + 5),
             ("p-2", json.dumps([a_low, "no-node-named"]), 3, 4, held_day + 9, held_day + 9)])
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection:
        carried = connection.execute("SELECT day, node_id, tokens FROM host_tokens_daily ORDER BY 1, 2").fetchall()
        assert connection.execute("SELECT name FROM sqlite_master WHERE name = 'shard_tokens_daily'").fetchone() is None
    # The pruned day's calls are gone, so what it counted stays; the held day counts p-1 once on a.
    assert carried == [(pruned_day, "a", 200), (held_day, "a", 12 + 7), (held_day, "b", 12),
                       (held_day, "no-node-named", 7)]

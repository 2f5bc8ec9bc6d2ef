"""The dashboards' ages on stand-in read models: every age a panel shows is measured to the end of the chosen time
range, never negative when the read model already holds something newer than that end (a past range)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import DASHBOARDS
from tests.readmodel_helpers import LogBuilder, advertised, apply_all, at, heartbeat, migrated_engine

PANELS = {panel.title: panel for dashboard in DASHBOARDS for panel in dashboard.sql_panels}


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

"""The Mesh panels against the router: on stand-in read-model rows, a panel's SQL (macros expanded as Grafana's
SQLite plugin expands them) shows a shard live, a layer covered and a model servable exactly when the router
(hearth/services/orchestrator/router.py) would use them; and the Pipelines panels count every call, routed or
not."""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker
from typer.testing import CliRunner

from hearth.events.models import PipelineAborted, PipelineFallbackLocal
from hearth.services.cli import app
from hearth.services.common.config import DistributedInferenceSettings
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.grafana_json import dashboard_json
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import DASHBOARDS
from hearth.services.dashboards.status import status_tables
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from tests.readmodel_helpers import (MODEL_ID, T0, WEIGHTS_SHA, LogBuilder, advertised, apply_all, at, heartbeat,
                                     migrated_engine)

PANELS = {panel.title: panel for dashboard in DASHBOARDS for panel in dashboard.sql_panels}
ROUTING = DistributedInferenceSettings()
OTHER_WEIGHTS = "cd" * 32
REMOVED_NODE = "gone"


def read_model(path: Path, events) -> Path:
    engine = migrated_engine(path)
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in events])
    engine.dispose()
    return path


def panel_rows(db: Path, title: str, now_s: int, span_s: int = 3600) -> list[dict]:
    with contextlib.closing(open_read_only(db)) as connection:
        columns, rows = run_panel_sql(connection, PANELS[title].sql, TimeRange(now_s - span_s, now_s))
    return [dict(zip(columns, row)) for row in rows]


def router_at(db: Path, now_s: float, removed: frozenset[str] = frozenset()) -> ShardRouter:
    engine = migrated_engine(db)  # already at head: only opens it
    return ShardRouter(sessionmaker(engine), health_timeout_s=ROUTING.shard_health_timeout_s,
                       silent_log_grace_s=ROUTING.silent_log_grace_s, allow_self_as_shard=True, self_node_id="hub",
                       clock=lambda: now_s,
                       node_membership=lambda node: "its member was removed" if node in removed else None)


def epoch(seconds: float) -> int:
    return int(at(seconds).timestamp())


@pytest.mark.parametrize("second_half", [dict(quantization="int4/g64"), dict(weights_sha256=OTHER_WEIGHTS)],
                         ids=["another scheme", "other weights"])
def test_a_model_covered_only_by_mixing_schemes_or_weights_is_not_shown_servable(tmp_path, second_half):
    db = read_model(tmp_path / "rm.sqlite", [
        advertised(0, 3, "a", quantization="int8"), advertised(4, 7, "b", **{"quantization": "int8", **second_half}),
        heartbeat(f"{MODEL_ID}:0-3+int8@a", t=5, node="a"),
    ])
    now_s = epoch(10)
    router = router_at(db, now_s)
    with pytest.raises(RoutingError):
        router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, now=router.now())
    models = panel_rows(db, "Models", now_s)
    assert models and all(row["covered_layers"] < row["layers"] for row in models), models
    assert {(row["quantization"], row["covered_layers"]) for row in models} >= {("int8", 4)}, models
    replicas = panel_rows(db, "Live replicas per layer", now_s)
    assert len(replicas) == 2 * 8 and sum(row["replicas"] for row in replicas) == 8, replicas


def mesh_events():
    """Five shards of one model (every one layers 0-7, so each alone could serve it): `early` heard last at 1 s,
    `steady` heartbeating to 150 s (its advert expires at 120 s, as every one here), `held` quarantined, `gone`
    its member removed at 5 s, `late` advertised at 30 s."""
    events = [advertised(0, 7, node, t=0) for node in ("early", "steady", "held", REMOVED_NODE)]
    events.append(advertised(0, 7, "late", t=30))
    events.append(heartbeat(f"{MODEL_ID}:0-7@early", t=1, node="early"))
    events += [heartbeat(f"{MODEL_ID}:0-7@steady", t=t, node="steady") for t in range(10, 151, 10)]
    return sorted(events, key=lambda event: event.occurred_at)


@pytest.fixture(scope="module")
def mesh_db(tmp_path_factory) -> Path:
    db = read_model(tmp_path_factory.mktemp("mesh") / "rm.sqlite", mesh_events())
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("INSERT INTO shard_reputation (shard_id, node_id, checks, verified_positions, mismatches, "
                           "disputes, status, updated_at, first_event_at) VALUES (?, 'held', 0, 0, 1, 0, "
                           "'quarantined', ?, ?)", (f"{MODEL_ID}:0-7@held", epoch(0), epoch(0)))
        connection.execute("INSERT INTO member_removals (stream, public_key, member, event_id, removed_at) "
                           "VALUES ('HEARTH_SHARDS', 'UKEY', ?, 'e-removed', ?)", (REMOVED_NODE, epoch(5)))
    return db


# 20 s: everyone heard recently enough; 40 s: `early` silent 39 s while `steady` is heard (stale); 120 s: the adverts
# advertised at 0 s expire (the router's `now >= expires_at`); 175 s: nothing heard for 25 s (the silent-log grace
# holds `now` back); 200 s: past the grace.
@pytest.mark.parametrize("seconds", [20, 40, 119, 120, 175, 200])
def test_a_shard_is_live_on_the_mesh_panels_exactly_when_the_router_would_use_it(mesh_db, seconds):
    now_s = epoch(seconds)
    router = router_at(mesh_db, now_s, removed=frozenset({REMOVED_NODE}))
    candidates = router.all_candidates()
    routable = {shard.node_id for shard in candidates if router.alive(shard, router.now())}
    shards = panel_rows(mesh_db, "Shards advertised", now_s)
    assert {row["node"] for row in shards if row["state"] == "live"} == routable, shards
    replicas = panel_rows(mesh_db, "Live replicas per layer", now_s)
    assert {row["replicas"] for row in replicas} == {len(routable)}, replicas
    models = panel_rows(mesh_db, "Models", now_s)
    assert [row["covered_layers"] == row["layers"] for row in models] == [bool(routable)], models


def test_the_shards_table_says_why_an_advertised_shard_is_not_used(mesh_db):
    states = {row["node"]: row["state"] for row in panel_rows(mesh_db, "Shards advertised", epoch(40))}
    assert states == {"early": "stale", "steady": "live", "held": "quarantined", REMOVED_NODE: "member removed",
                      "late": "live"}
    # An expired advert is no longer listed, whatever its heartbeats.
    assert {row["node"] for row in panel_rows(mesh_db, "Shards advertised", epoch(130))} == {"late"}


def test_the_shards_table_shows_each_shards_quantization(tmp_path):
    db = read_model(tmp_path / "rm.sqlite", [advertised(0, 7, "a", quantization="int4/g64")])
    [row] = panel_rows(db, "Shards advertised", epoch(5))
    assert row["quantization"] == "int4/g64"


def test_the_routing_settings_decide_liveness_and_every_one_a_panel_names_is_a_dashboard_constant(mesh_db):
    with contextlib.closing(open_read_only(mesh_db)) as connection:
        columns, rows = run_panel_sql(connection, PANELS["Shards advertised"].sql, TimeRange(epoch(0), epoch(40)),
                                      {"shard_health_timeout_s": 60, "silent_log_grace_s": 30})
    states = {row[columns.index("node")]: row[columns.index("state")] for row in rows}
    assert states["early"] == "live"  # silent 39 s: stale at 30 s (the default), live at 60 s
    for dashboard in DASHBOARDS:
        built = dashboard_json(dashboard)
        constants = {variable["name"]: variable for variable in built["templating"]["list"]}
        named = {name for panel in dashboard.sql_panels for name in re.findall(r"\$\{(\w+)\}", panel.sql)}
        assert set(constants) == named, dashboard.title
        for name in named:
            assert constants[name]["type"] == "constant" and float(constants[name]["query"]) == getattr(ROUTING, name)


def test_a_call_that_never_got_a_chain_is_counted_where_it_ended(tmp_path):
    refused = PipelineAborted(node_id="hub", pipeline_id="p-refused", code="shard_unavailable",
                              reason="no healthy shard covers layers 4-7", occurred_at=at(30))
    gone_local = PipelineFallbackLocal(node_id="hub", pipeline_id="p-local", reason="no healthy shard",
                                       occurred_at=at(90))
    db = read_model(tmp_path / "rm.sqlite", [advertised(0, 3, "a"), refused, gone_local])
    now_s = epoch(120)
    assert panel_rows(db, "Aborts by code", now_s) == [{"code": "shard_unavailable", "aborts": 1}]
    assert [(row["time"], row["outcome"], row["calls"]) for row in panel_rows(
        db, "Calls per minute by outcome", now_s)] == [(epoch(0), "aborted", 1), (epoch(60), "fallback_local", 1)]
    assert [(row["time"], row["kind"], row["events"]) for row in panel_rows(
        db, "Failovers and fallbacks per minute", now_s)] == [(epoch(60), "fallback_local", 1)]
    with contextlib.closing(open_read_only(db)) as connection:
        calls = status_tables(connection, now_s)[-1]
    assert calls.row_count == 2


def test_a_hosts_counters_stay_under_its_name_once_its_shard_rows_are_pruned(tmp_path):
    # The shards rows go with the shards stream's retention; counters stay far longer (tokens per host per day are
    # keyed by the host itself: test_dashboard_counts_and_ages.py).
    db = read_model(tmp_path / "rm.sqlite", [advertised(4, 7, "a")])
    pruned, current = f"{MODEL_ID}:0-3@a", f"{MODEL_ID}:4-7@a"
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.executemany("INSERT INTO shard_stats (shard_id, tokens_served, pipelines_joined, "
                               "failovers_caused, corruption_detections) VALUES (?, 0, 1, 0, 0)",
                               [(pruned,), (current,)])
    nodes = [row["node"] for row in panel_rows(
        db, "Reputation: pipelines joined, failovers caused, corruption detected", epoch(0))]
    assert nodes == ["a", "a"]


def test_hearth_status_judges_liveness_with_its_configurations_health_timeout(tmp_path, monkeypatch):
    now_rel = time.time() - T0.timestamp()  # the command reads the wall clock
    db = read_model(tmp_path / "rm.sqlite", [
        advertised(0, 7, "quiet", t=now_rel - 45), advertised(0, 7, "chatty", t=now_rel - 45),
        heartbeat(f"{MODEL_ID}:0-7@chatty", t=now_rel - 1, node="chatty")])
    monkeypatch.setenv("COLUMNS", "250")
    config = tmp_path / "hearth.toml"
    config.write_text("[research.distributed_inference]\nshard_health_timeout_s = 120\n")

    def state_of_quiet(*options: str) -> str:
        result = CliRunner().invoke(app, [*options, "status", "--db", str(db)])
        assert result.exit_code == 0, result.output
        [row] = [line for line in result.output.splitlines() if "│ quiet " in line]
        return row

    assert " stale " in state_of_quiet()  # silent 45 s: past the default 30 s
    assert " live " in state_of_quiet("--config", str(config))

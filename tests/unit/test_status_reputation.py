"""Reputation on `hearth status` and the dashboards: the shards advertised carry their status, the reputation table
counts verified and quarantined shards (and the nodes they hold) and lists the ones with a mismatch or a dispute, a
shard held out by its node's quarantine says which shard holds it, the panel runs."""

from __future__ import annotations

import contextlib

from rich.console import Console

from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import REPUTATION_SQL, SHARD_HOSTS
from hearth.services.dashboards.routing_sql import MODELS_SQL, SHARDS_ADVERTISED_SQL
from hearth.protocol.quarantine import node_quarantine_reason
from hearth.services.dashboards.status import run_status_command
from tests.readmodel_helpers import LogBuilder, advertised, apply_all, heartbeat, migrated_engine
from tests.reputation_events import confirmed, disputed, verified

NODES = ("node-a", "node-b", "node-c", "node-d")


def read_model(tmp_path):
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    log = LogBuilder()
    shards = [advertised(0, 7, node, total=8) for node in NODES]
    a, b, c, _ = (shard.shard_id for shard in shards)
    events = shards + [heartbeat(s.shard_id, node=s.node_id) for s in shards] + [
        verified("p1", {a: (2, 20), b: (2, 20), c: (1, 4)}), disputed("p2", [b, c]), confirmed("p3", a, [b, c])]
    apply_all(engine, [log.stored(event) for event in events])
    engine.dispose()
    return path, shards


def test_status_shows_reputation(tmp_path):
    path, shards = read_model(tmp_path)
    now_s = int(shards[0].occurred_at.timestamp()) + 5
    console = Console(width=400, record=True)
    assert run_status_command(path, now_s=now_s, console=console) == 0
    screen = console.export_text()
    assert "Reputation: 3 shards verified, 1 quarantined" in screen
    rows = {line.split("│")[1].strip(): line for line in screen.splitlines() if line.count("│") > 5}
    assert "quarantined" in rows["node-a"] and "relative error 0.42" in screen
    with contextlib.closing(open_read_only(path)) as connection:
        columns, online = run_panel_sql(connection, SHARDS_ADVERTISED_SQL, TimeRange(now_s - 60, now_s))
        by_node = {row[columns.index("node")]: row[columns.index("reputation")] for row in online}
        assert by_node == {"node-a": "quarantined", "node-b": "ok", "node-c": "ok", "node-d": "unchecked"}
        columns, listed = run_panel_sql(connection, REPUTATION_SQL, TimeRange(now_s - 60, now_s))
    assert [row[columns.index("node")] for row in listed] == ["node-a", "node-b", "node-c"]
    assert listed[0][columns.index("since")] is not None and listed[1][columns.index("since")] is None
    assert any(panel.sql == REPUTATION_SQL for panel in SHARD_HOSTS.sql_panels)


def test_a_shard_of_a_quarantined_node_says_which_shard_holds_it(tmp_path):
    path, shards = read_model(tmp_path)
    engine = migrated_engine(path)
    log = LogBuilder()
    for _ in range(2 * len(NODES)):  # the shards stream's events read_model applied came first
        log.stored(shards[0])
    restarted = advertised(0, 6, "node-a", total=8)  # the caught node again, under a new shard id
    apply_all(engine, [log.stored(restarted), log.stored(heartbeat(restarted.shard_id, node="node-a"))])
    engine.dispose()
    now_s = int(shards[0].occurred_at.timestamp()) + 5
    with contextlib.closing(open_read_only(path)) as connection:
        columns, online = run_panel_sql(connection, SHARDS_ADVERTISED_SQL, TimeRange(now_s - 60, now_s))
    by_shard = {row[columns.index("shard")]: row[columns.index("reputation")] for row in online}
    assert by_shard[restarted.shard_id] == node_quarantine_reason("node-a", shards[0].shard_id)
    assert by_shard[shards[0].shard_id] == "quarantined" and by_shard[shards[1].shard_id] == "ok"
    console = Console(width=400, record=True)
    assert run_status_command(path, now_s=now_s, console=console) == 0
    screen = console.export_text()
    assert "Reputation: 3 shards verified, 1 quarantined (nodes held, none of their shards routed: node-a)" in screen
    assert node_quarantine_reason("node-a", shards[0].shard_id) in screen



def test_replicas_count_only_shards_routing_may_use(tmp_path):
    path, shards = read_model(tmp_path)  # node-a's shard quarantined; four nodes each hold all 8 layers
    now_s = int(shards[0].occurred_at.timestamp()) + 5
    with contextlib.closing(open_read_only(path)) as connection:
        columns, models = run_panel_sql(connection, MODELS_SQL, TimeRange(now_s - 60, now_s))
    [row] = models
    assert row[columns.index("min_replicas")] == 3  # node-a's is not one routing would use
    assert row[columns.index("shards_advertised")] == 4


def test_status_piped_writes_every_name_whole(tmp_path, capsys):
    """Printed to a pipe (capsys: not a terminal), rich's 80 columns cut a long node name to `the…`; the tables are
    as wide as what they hold there, and a grep for the name finds its row."""
    node = "the-attic-workstation-under-the-stairs-" + "x" * 40
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    shard = advertised(0, 7, node, total=8)
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in (shard, heartbeat(shard.shard_id, node=node))])
    engine.dispose()
    assert run_status_command(path, now_s=int(shard.occurred_at.timestamp()) + 5) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if node in line]
    assert len(rows) == 1 and "live" in rows[0] and "tiny/llama-test" in rows[0], rows


def test_status_rounds_figures_to_one_decimal(tmp_path, capsys):
    """A step time the read model holds as 9.69014 ms reads 9.7 on the status screen, not six digits."""
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    shard = advertised(0, 7, "attic", total=8)
    beat = heartbeat(shard.shard_id, node="attic").model_copy(update={"p95_latency_ms": 9.69014})
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in (shard, beat)])
    engine.dispose()
    assert run_status_command(path, now_s=int(shard.occurred_at.timestamp()) + 5) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "attic" in line and "live" in line)
    assert "9.7" in row.split() and "9.69014" not in row, row

"""Every dashboard panel's SQL against a read model a real run filled: a mesh of real processes (three primaries,
a replica for layers 2-3, an orchestrator, a projector) serves two calls, a call whose middle shard is killed
mid-generation (a failover), a call whose client goes away (an abort), and an unsigned event a broker user
slipped in (a rejected event); layers 0-1 have no replica, so every completed call's verification is unmet. Each
panel's query, expanded as the Grafana SQLite plugin expands it, must return the columns the panel draws and at
least one row; `hearth status` and the PNG renders read the same file.

Set HEARTH_DASHBOARDS_PNG_OUT=docs/img to refresh the README's pictures from this run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hearth.events.models import ShardHeartbeat
from hearth.events.publish import publish_event
from hearth.services.client.chat import stream_chat
from hearth.services.broker.connection import connect_nats
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import run_panel_sql
from hearth.services.dashboards.panels import DASHBOARDS
from hearth.services.dashboards.render import data_time_range, render_all
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.failover_support import (
    ACT_AFTER_TOKENS,
    PRIMARY_WEIGHT,
    chat_request,
    leaving_client_request,
    failover_mesh,
    stream_with_action,
    wait_for_pipeline_end,
)

pytestmark = [pytest.mark.scheduled_first, pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_CALLS = 4
READ_MODEL_WAIT_S = 60.0
POLL_INTERVAL_S = 0.2
# The replica's host asks to be used last, far more than failover tests' replicas do: routing weighs measured step
# times and round trips too, and on a loaded machine the replica (measured as a mirror) once outweighed the primary
# at the failover tests' weight, so the shard the test kills was not in the chain.
LAST_RESORT_WEIGHT = 8.0


@pytest.fixture(scope="module")
def read_model(tmp_path_factory, tiny_models_dir) -> Path:
    """A snapshot of the projector's read model taken while the mesh still runs (stopping it withdraws every
    shard), once the killed shard's advertisement has expired in it."""
    folder = tmp_path_factory.mktemp("dashboards-readmodel")
    db, snapshot = folder / "live.sqlite", folder / "readmodel.sqlite"
    with failover_mesh(tmp_path_factory, tiny_models_dir, "dashboards") as mesh:
        mesh.cluster.start_projector(db)
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False)
        mesh.start_shard("r1", *THREE_SHARD_RANGES[1], hop_weight=LAST_RESORT_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        asyncio.run(_run_calls(mesh))
        _wait_for_rows(db, "SELECT COUNT(*) FROM pipelines WHERE status IN ('completed', 'aborted')", EXPECTED_CALLS)
        _wait_for_rows(db, "SELECT COUNT(*) FROM rejected_events", 1)
        _wait_for_rows(db, "SELECT (SELECT MAX(last_seen) FROM shard_health) > "
                           "(SELECT expires_at FROM shards WHERE node_id = 'p1')", 1)
        with contextlib.closing(open_read_only(db)) as live, contextlib.closing(sqlite3.connect(snapshot)) as copy:
            live.backup(copy)
    return snapshot


async def _run_calls(mesh) -> None:
    nc = await connect_nats(mesh.cluster.nats_url, name="dashboards-test", settings=mesh.cluster.nats_settings())
    try:
        pipeline_ids = []
        for _ in range(2):
            pipeline_ids.append((await stream_with_action(nc, chat_request())).pipeline_id)
        victim = mesh.shards["p1"]
        await mesh.wait_idle_in_routing(victim)  # routing prefers the idle shard before the lower hop_weight
        failed_over = await stream_with_action(nc, chat_request(), lambda: victim.process.signal(signal.SIGKILL))
        assert victim.shard_id in failed_over.first_hops, failed_over.first_hops
        assert failed_over.final.type == "done" and failed_over.of_type("shard_failover"), failed_over.final
        pipeline_ids.append(failed_over.pipeline_id)
        tokens = 0
        async for frame in stream_chat(nc, leaving_client_request()):
            if frame.type == "pipeline":
                pipeline_ids.append(frame.pipeline_id)
            tokens += frame.type == "token_delta"
            if tokens == ACT_AFTER_TOKENS:
                break  # the client goes away: the orchestrator aborts the call (client_gone)
        for pipeline_id in pipeline_ids:
            await wait_for_pipeline_end(nc, pipeline_id)
        # The system user stands for a misconfigured broker: an unsigned heartbeat lands in rejected_events.
        forged = ShardHeartbeat(shard_id=f"{TINY_MODEL_NAME}:0-1@intruder", queue_depth=0, active_streams=0,
                                p95_latency_ms=1.0, tokens_served_total=0, node_id="intruder")
        await publish_event(nc.jetstream(), forged)
    finally:
        await nc.close()


def _wait_for_rows(db: Path, count_sql: str, at_least: int) -> None:
    deadline = time.monotonic() + READ_MODEL_WAIT_S
    while True:
        with contextlib.suppress(sqlite3.OperationalError), contextlib.closing(open_read_only(db)) as connection:
            if connection.execute(count_sql).fetchone()[0] >= at_least:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"the read model never had {at_least} rows for {count_sql!r}")
        time.sleep(POLL_INTERVAL_S)


@pytest.mark.parametrize("panel", [panel for dashboard in DASHBOARDS for panel in dashboard.sql_panels],
                         ids=lambda panel: panel.title)
def test_every_sql_panel_returns_its_columns_and_rows(read_model, panel):
    with contextlib.closing(open_read_only(read_model)) as connection:
        columns, rows = run_panel_sql(connection, panel.sql, data_time_range(connection))
    assert set(panel.columns) <= set(columns), (panel.title, columns)
    assert rows, f"{panel.title}: no rows"
    if panel.time_series:
        assert all(isinstance(row[columns.index("time")], int) for row in rows), rows


def test_the_run_shows_on_the_panels_as_it_happened(read_model):
    with contextlib.closing(open_read_only(read_model)) as connection:
        time_range = data_time_range(connection)
        by_title = {panel.title: panel for dashboard in DASHBOARDS for panel in dashboard.sql_panels}

        def rows(title):
            return run_panel_sql(connection, by_title[title].sql, time_range)[1]

        outcomes = {}
        for _time, outcome, calls in rows("Calls per minute by outcome"):
            outcomes[outcome] = outcomes.get(outcome, 0) + calls
        assert outcomes == {"completed": 3, "aborted": 1}, outcomes
        assert rows("Aborts by code") == [("client_gone", 1)]
        # Layers 0-1 have no replica to check them on: every completed call's verification (sampled) is unmet.
        unmet = rows("Calls per hour whose verification was unmet, by model")
        assert {model for _t, model, _n in unmet} == {TINY_MODEL_NAME} and sum(n for *_, n in unmet) == 3, unmet
        assert sum(events for _t, kind, events in rows("Failovers and fallbacks per minute") if kind == "failover") == 1
        assert {reason for _t, reason, _n in rows("Rejected events per minute by reason")} == {"unsigned"}
        assert [model for model, *_ in rows("Models")] == [TINY_MODEL_NAME]


def test_hearth_status_shows_models_shards_and_calls(read_model):
    with contextlib.closing(open_read_only(read_model)) as connection:
        now_s = data_time_range(connection).to_s
    code = (
        "import sys; from pathlib import Path; from rich.console import Console; "
        "from hearth.services.dashboards.status import run_status_command; "
        f"sys.exit(run_status_command(Path({str(read_model)!r}), now_s={now_s}, console=Console(width=200)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    screen = result.stdout
    assert TINY_MODEL_NAME in screen and "6/6" in screen, screen
    for node in ("p0", "r1", "p2"):
        assert f" {node} " in screen, screen
    assert " p1 " not in screen, screen  # killed: its advertisement expired
    assert "completed" in screen and "aborted" in screen, screen
    cli = subprocess.run([sys.executable, "-m", "hearth.services.cli", "status", "--db", str(read_model)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert cli.returncode == 0 and "Shards advertised" in cli.stdout, cli.stdout + cli.stderr


def test_each_dashboard_renders_as_a_png(read_model, tmp_path):
    out = Path(os.environ.get("HEARTH_DASHBOARDS_PNG_OUT") or tmp_path)
    paths = render_all(read_model, out)
    assert [path.name for path in paths] == [f"dashboard-{name}.png" for name in
                                             ("mesh", "pipelines", "shard-hosts", "event-log")]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in paths)

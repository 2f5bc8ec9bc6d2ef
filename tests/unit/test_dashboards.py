"""The Grafana dashboards as files: generated JSON in step with hearth/services/dashboards/panels.py, datasources the
provisioning defines, only the agreed metric names in PromQL, panel SQL valid on a real read model, the plugin's
macros expanded as the plugin expands them, and a read-only reader that never blocks the projector."""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.dashboards.grafana_json import DASHBOARDS_DIR, write_dashboards
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, expand, run_panel_sql
from hearth.services.dashboards.model import PROMETHEUS_DATASOURCE, READ_MODEL_DATASOURCE, PromPanel
from hearth.services.dashboards.panels import DASHBOARDS
from hearth.services.dashboards.status import coverage_text, run_status_command
from tests.readmodel_helpers import T0, LogBuilder, apply_all, migrated_engine, synthetic_events

ROOT = Path(__file__).resolve().parents[2]
PROVISIONING = ROOT / "grafana" / "provisioning"
# The metric names agreed with the metrics side (issue 15); no panel may query another.
AGREED_METRICS = {
    "hearth_pipeline_construct_seconds", "hearth_first_token_seconds", "hearth_decode_tokens_per_second",
    "hearth_shard_latency_seconds", "hearth_failovers_total", "hearth_fallback_to_local_total",
    "hearth_shard_corruption_detected_total", "hearth_requests_total", "hearth_calls_in_flight",
    "hearth_queued_requests", "hearth_shard_step_compute_seconds", "hearth_shard_active_sessions",
    "hearth_shard_kv_cache_bytes", "hearth_shard_tokens_served_total", "hearth_projector_events_applied_total",
    "hearth_projector_lag_events", "hearth_projector_lag_seconds", "hearth_events_rejected_total",
    "hearth_shard_prefix_lookups_total", "hearth_orchestrator_turn_seconds", "hearth_head_step_seconds",
    "hearth_event_outbox_depth",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
ALL_PANELS = [panel for dashboard in DASHBOARDS for panel in dashboard.panels]


def test_the_committed_dashboard_json_is_what_the_panels_generate():
    assert write_dashboards(DASHBOARDS_DIR, check=True) == [], "run `hearth dashboards build`"
    assert sorted(path.name for path in DASHBOARDS_DIR.glob("*.json")) == sorted(f"{d.uid}.json" for d in DASHBOARDS)


def test_every_panel_uses_a_provisioned_datasource_and_the_read_model_is_read_only():
    provisioned = yaml.safe_load((PROVISIONING / "datasources" / "hearth.yaml").read_text())["datasources"]
    by_uid = {source["uid"]: source for source in provisioned}
    assert by_uid[READ_MODEL_DATASOURCE["uid"]]["type"] == READ_MODEL_DATASOURCE["type"]
    assert by_uid[READ_MODEL_DATASOURCE["uid"]]["jsonData"] == {
        "path": "/data/readmodel.sqlite", "pathPrefix": "file:", "pathOptions": "mode=ro"}
    assert by_uid[PROMETHEUS_DATASOURCE["uid"]]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "hearth.yaml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    for path in DASHBOARDS_DIR.glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                assert target["datasource"]["uid"] in by_uid, (path.name, panel["title"])
                if target["datasource"] == READ_MODEL_DATASOURCE:
                    assert target["queryText"] == target["rawQueryText"] and target["timeColumns"] == ["time"]


@pytest.mark.parametrize("panel", [p for p in ALL_PANELS if isinstance(p, PromPanel)], ids=lambda p: p.title)
def test_promql_names_only_the_agreed_metrics(panel):
    for target in panel.targets:
        names = set(re.findall(r"hearth_[a-z_]+", target.expr))
        assert names, target.expr
        for name in names:
            base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
            assert base in AGREED_METRICS, (panel.title, name)
        assert target.expr.count("(") == target.expr.count(")"), target.expr
        assert set(re.findall(r"\[(\w+)\]", target.expr)) <= {"1m", "5m"}, target.expr


def test_macros_expand_as_the_plugin_expands_them():
    time_range = TimeRange(1_000, 2_000)
    # The plugin's documented examples (frser-sqlite-datasource README, pkg/plugin/macros.go).
    assert expand('$__unixEpochGroupSeconds("time", 10)', time_range) == 'cast(("time" / 10) as int) * 10'
    assert expand("$__unixEpochGroupSeconds(ts, 60, NULL)", time_range) == "cast((ts / 60) as int) * 60"
    assert expand("$__timeFilter(t)", time_range) == (
        "CAST(CASE WHEN typeof(t) = 'integer' THEN t ELSE strftime(\"%s\", t) END AS INTEGER) BETWEEN 1000 AND 2000")
    assert expand("time >= $__from / 1000 and time < $__to / 1000", time_range) == (
        "time >= 1000000 / 1000 and time < 2000000 / 1000")
    assert expand("$__unknownMacro(x)", time_range) == "$__unknownMacro(x)"


@pytest.fixture(scope="module")
def synthetic_read_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dashboards") / "readmodel.sqlite"
    engine = migrated_engine(path)
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in synthetic_events(pipelines=60, heartbeats_per_shard=8)])
    engine.dispose()
    return path


@pytest.mark.parametrize("panel", [p for d in DASHBOARDS for p in d.sql_panels], ids=lambda p: p.title)
def test_every_sql_panel_runs_on_a_projected_read_model(synthetic_read_model, panel):
    t0 = int(T0.timestamp())
    with contextlib.closing(open_read_only(synthetic_read_model)) as connection:
        columns, _rows = run_panel_sql(connection, panel.sql, TimeRange(t0 - 60, t0 + 60))
    assert set(panel.columns) <= set(columns), columns


def test_event_counts_count_each_applied_event_once(synthetic_read_model):
    events = synthetic_events(pipelines=60, heartbeats_per_shard=8)
    expected = Counter((int(e.occurred_at.timestamp()) // 60 * 60, e.type) for e in events)
    with contextlib.closing(open_read_only(synthetic_read_model)) as connection:
        counted = {(minute, kind): n for minute, kind, n in connection.execute("SELECT * FROM event_counts")}
    assert counted == dict(expected)


def test_host_tokens_daily_counts_each_completed_call_on_each_of_its_hosts(synthetic_read_model):
    with contextlib.closing(open_read_only(synthetic_read_model)) as connection:
        expected = connection.execute(
            "SELECT SUM((prompt_tokens + completion_tokens) * (SELECT COUNT(DISTINCT substr(value, instr(value, '@') "
            "+ 1)) FROM json_each(hops))) FROM pipelines WHERE status = 'completed'").fetchone()[0]
        counted, days = connection.execute("SELECT SUM(tokens), COUNT(DISTINCT day) FROM host_tokens_daily").fetchone()
    assert counted == expected and expected > 0
    assert days == 1


# Nearest-rank percentiles per minute straight from the pipelines rows, as a reference for pipeline_minutes.
REFERENCE_PERCENTILES = """WITH bucketed AS (
  SELECT constructed_at / 60 * 60 AS minute, {value} AS value FROM pipelines WHERE {condition}
), ranked AS (
  SELECT minute, value, ROW_NUMBER() OVER (PARTITION BY minute ORDER BY value) AS rank,
         COUNT(*) OVER (PARTITION BY minute) AS n FROM bucketed
)
SELECT minute, MIN(CASE WHEN rank >= 0.5 * n THEN value END), MIN(CASE WHEN rank >= 0.95 * n THEN value END)
FROM ranked GROUP BY minute ORDER BY minute"""


def test_pipeline_minutes_hold_each_minutes_nearest_rank_percentiles(tmp_path):
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    log = LogBuilder()
    events = [log.stored(event) for event in synthetic_events(pipelines=400, heartbeats_per_shard=2)]
    for start in range(0, len(events), 97):  # many batches: a minute's calls end in different batches
        apply_all(engine, events[start:start + 97])
    engine.dispose()
    with contextlib.closing(open_read_only(path)) as connection:
        minutes = connection.execute("SELECT minute, calls, ttft_p50_ms, ttft_p95_ms, tokens_per_second_p50, "
                                     "tokens_per_second_p95 FROM pipeline_minutes ORDER BY minute").fetchall()
        ttft = connection.execute(
            REFERENCE_PERCENTILES.format(value="ttft_ms", condition="ttft_ms IS NOT NULL")).fetchall()
        rates = connection.execute(REFERENCE_PERCENTILES.format(
            value="tokens_per_second", condition="status = 'completed'")).fetchall()
        calls = connection.execute("SELECT constructed_at / 60 * 60, COUNT(*) FROM pipelines GROUP BY 1").fetchall()
    assert len(minutes) > 1
    assert [(m, n) for m, n, *_ in minutes] == calls
    assert [(m, p50, p95) for m, _n, p50, p95, _r50, _r95 in minutes] == ttft
    assert [(m, r50, r95) for m, _n, _p50, _p95, r50, r95 in minutes] == rates


def test_a_read_only_reader_never_blocks_the_projector(tmp_path):
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    log = LogBuilder()
    events = [log.stored(event) for event in synthetic_events(pipelines=10, heartbeats_per_shard=2)]
    apply_all(engine, events[:20])
    with contextlib.closing(open_read_only(path)) as reader:
        reader.execute("BEGIN")
        before = reader.execute("SELECT SUM(events) FROM event_counts").fetchone()[0]
        # The projector commits while the reader's transaction is open (it would fail with "database is
        # locked" after the busy timeout if readers blocked writers).
        assert apply_all(engine, events[20:]) == len(events) - 20
        assert reader.execute("SELECT SUM(events) FROM event_counts").fetchone()[0] == before  # its snapshot
        reader.execute("COMMIT")
        assert reader.execute("SELECT SUM(events) FROM event_counts").fetchone()[0] == len(events)
        with pytest.raises(Exception, match="readonly"):
            reader.execute("DELETE FROM event_counts")
    engine.dispose()


def test_status_screen_pieces(tmp_path, capsys):
    assert coverage_text([(0, 2), (1, 2), (2, 1), (3, 0)]) == "0-1 x2, 2 x1, 3 MISSING"
    assert run_status_command(tmp_path / "absent.sqlite") == 1
    assert "no read model" in capsys.readouterr().err  # a refusal, on stderr as every command's


def test_status_on_a_file_that_is_not_a_database_is_one_line(tmp_path, capsys):
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"not a database " * 512)
    assert run_status_command(corrupt) == 1
    # One line whatever the console's width: before, a long path was broken across lines, even inside a name.
    said = capsys.readouterr().err
    assert said == f"hearth status: {corrupt} is not a migrated read model (file is not a database)\n"


@pytest.mark.parametrize("name", ["read#model.sqlite", "read?mode=rwc.sqlite", "read%20model.sqlite"])
def test_status_reads_the_file_its_path_names_whatever_characters_the_path_holds(tmp_path, capsys, name):
    made = tmp_path / "made.sqlite"
    migrated_engine(made).dispose()
    path = made.rename(tmp_path / name)
    assert run_status_command(path) == 0, capsys.readouterr().out
    # Nothing opened (and so created) under the part of the name before a `#` or `?`.
    assert sorted(child.name for child in tmp_path.iterdir()) == sorted(
        [name, f"{name}-shm", f"{name}-wal"] if (tmp_path / f"{name}-wal").exists() else [name])


def nothing_at(path: Path) -> Path:
    return path


def an_empty_file(path: Path) -> Path:
    path.touch()
    return path


def a_read_model_without_events(path: Path) -> Path:
    migrated_engine(path).dispose()
    return path


@pytest.mark.parametrize("made", [nothing_at, an_empty_file, a_read_model_without_events])
def test_rendering_what_is_no_read_model_with_events_is_one_line(tmp_path, made):
    db = made(tmp_path / "readmodel.sqlite")
    result = CliRunner().invoke(app, ["dashboards", "render", "--db", str(db), "--out", str(tmp_path / "img")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    said = " ".join(result.stderr.split())
    assert said.startswith("hearth dashboards render: ") and str(db) in said, said
    assert not (tmp_path / "img").exists()

"""`hearth status`: one screen from a read model: models and their layer coverage (per quantization scheme and
weights), shards advertised (with their state by the router's rule and their reputation), shards verification has
found fault with, recent calls (by outcome, and how many of the checked ones had their verification unmet).

It runs the Mesh dashboard's own SQL (hearth/services/dashboards/panels.py) on a read-only connection, with "now"
as the end of the time range, so the screen and the dashboard never disagree. Heartbeat ages are from this
machine's clock.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from collections.abc import Mapping
from itertools import groupby
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hearth.protocol.quarantine import quarantined_nodes
from hearth.readmodels.queries import coverage_text
from hearth.services.common.display import display_cell
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import CALLS_IN_RANGE, CHECKED_CALL, REPUTATION_SQL
from hearth.services.dashboards.routing_sql import (LAYER_REPLICAS_CTE, MODELS_SQL, ROUTING_VARIABLES,
                                                    SHARDS_ADVERTISED_SQL)

RECENT_CALLS_S = 3600
# Printed to a pipe or a file (a CI log, grep), the tables are as wide as what they hold, up to this: rich's own width
# there is 80 columns, and it cut member names and model ids to fit ("the…"). A terminal keeps its own width.
NOT_A_TERMINAL_WIDTH = 10_000

LAYER_REPLICAS_SQL = f"""{LAYER_REPLICAS_CTE}
SELECT model_id, quantization, substr(weights_sha256, 1, 12), layer, replicas FROM layer_replicas
ORDER BY model_id, quantization, weights_sha256, layer"""
# A call's verification counts as the Pipelines dashboard's unmet panel counts it: among the calls checked at all.
CALLS_BY_OUTCOME_SQL = f"""SELECT status AS outcome, COUNT(*) AS calls, ROUND(AVG(ttft_ms)) AS mean_ttft_ms,
       ROUND(AVG(tokens_per_second), 1) AS mean_tokens_per_s, SUM({CHECKED_CALL}) AS checked_calls,
       SUM(verification = 'unmet') AS unmet_calls
FROM pipelines WHERE {CALLS_IN_RANGE} GROUP BY status ORDER BY calls DESC"""


def status_tables(connection: sqlite3.Connection, now_s: int,
                  routing: Mapping[str, float] = ROUTING_VARIABLES) -> list[Table]:
    """The four tables of the screen, read from one connection at `now_s` (epoch seconds); `routing`: the
    orchestrators' shard_health_timeout_s and silent_log_grace_s, which decide which shards are live."""
    time_range = TimeRange(now_s - RECENT_CALLS_S, now_s)
    _, per_layer = run_panel_sql(connection, LAYER_REPLICAS_SQL, time_range, routing)
    coverage = {group: coverage_text([(layer, n) for *_, layer, n in rows])
                for group, rows in groupby(per_layer, key=lambda row: row[:3])}

    models = Table(title="Models (per quantization and weights)", title_justify="left")
    for name in ("model", "quantization", "weights", "layers covered", "min replicas", "shards",
                 "coverage (layers x live replicas)"):
        models.add_column(name)
    for model, scheme, weights, layers, covered, min_replicas, shards in run_panel_sql(
            connection, MODELS_SQL, time_range, routing)[1]:
        style = None if covered == layers else "bold red"
        _add_row(models, model, scheme, weights, f"{covered}/{layers}", str(min_replicas), str(shards),
                 coverage.get((model, scheme, weights), ""), style=style)

    shards = Table(title="Shards advertised", title_justify="left")
    for name in ("node", "model", "quantization", "layers", "dtype", "state", "memory MB", "heartbeat age s",
                 "active", "p95 step ms", "reputation"):
        shards.add_column(name, justify="right" if name[0].isdigit() or " " in name else "left")
    columns, rows = run_panel_sql(connection, SHARDS_ADVERTISED_SQL, time_range, routing)
    for row in rows:
        value = dict(zip(columns, row))
        _add_row(shards, value["node"], value["model"], value["quantization"], value["layers"], value["dtype"],
                 value["state"], _number(value["memory_mb"]), _number(value["heartbeat_age_s"]),
                 _number(value["active_streams"]), _number(value["p95_step_ms"]), value["reputation"],
                 style=None if value["state"] == "live" else "bold red")

    return [models, shards, reputation_table(connection, time_range), _calls_table(connection, time_range)]


def reputation_table(connection: sqlite3.Connection, time_range: TimeRange) -> Table:
    """A summary title (shards checked, quarantined, the nodes a quarantine holds) over the shards with a mismatch, a
    dispute or a quarantine."""
    columns, rows = run_panel_sql(connection, REPUTATION_SQL, time_range)
    shards = [dict(zip(columns, row)) for row in rows]
    quarantined = sum(shard["status"] == "quarantined" for shard in shards)
    held = sorted(quarantined_nodes(shard["shard"] for shard in shards if shard["status"] == "quarantined"))
    nodes = f" (nodes held, none of their shards routed: {', '.join(held)})" if held else ""
    table = Table(title=f"Reputation: {len(shards)} shards verified, {quarantined} quarantined{nodes}",
                  title_justify="left")
    for name in ("node", "shard", "status", "checks", "verified positions", "mismatches", "disputes", "since (UTC)",
                 "reason"):
        table.add_column(name)
    for shard in shards:
        if shard["status"] == "quarantined" or shard["mismatches"] or shard["disputes"]:
            _add_row(table, shard["node"], shard["shard"], shard["status"], str(shard["checks"]),
                          str(shard["verified_positions"]), str(shard["mismatches"]), str(shard["disputes"]),
                          shard["since"] or "-", shard["reason"],
                          style="bold red" if shard["status"] == "quarantined" else None)
    return table


def _calls_table(connection: sqlite3.Connection, time_range: TimeRange) -> Table:
    calls = Table(title=f"Calls in the last {RECENT_CALLS_S // 60} minutes", title_justify="left")
    for name in ("outcome", "calls", "mean ttft ms", "mean tokens/s", "verification unmet"):
        calls.add_column(name)
    for outcome, count, ttft, rate, checked, unmet in run_panel_sql(connection, CALLS_BY_OUTCOME_SQL, time_range)[1]:
        _add_row(calls, outcome, str(count), _number(ttft), _number(rate), _unmet_of_checked(checked, unmet),
                 style="bold red" if unmet else None)
    return calls


def _unmet_of_checked(checked: int, unmet: int) -> str:
    """`2 of 5 checked`; `-` when no call was checked (verify `none`, or an outcome that never completed). Which hop
    went unchecked and why is only in the orchestrator's log, so the screen does not guess at it."""
    return f"{unmet} of {checked} checked" if checked else "-"


def _add_row(table: Table, *cells: object, style: str | None = None) -> None:
    """A row of read-model values: members wrote some of them (model ids, reasons), so each is plain, escaped text
    (hearth/services/common/display.py), never rich markup or a terminal's escape sequence."""
    table.add_row(*(display_cell("" if cell is None else cell) for cell in cells), style=style)


def _number(value) -> str:
    """A read-model figure for a person: floats to one decimal (a step time of 9.69014 ms reads 9.7)."""
    if value is None:
        return "-"
    return f"{round(value, 1):g}" if isinstance(value, float) else str(value)


def _refuse(why: str) -> None:
    """The one line saying why there is no screen: on stderr, as every command's refusal, whatever the width."""
    print(f"hearth status: {why}", file=sys.stderr)


def _stdout_console() -> Console:
    """The console of standard output: a terminal's width where it is one, else NOT_A_TERMINAL_WIDTH."""
    console = Console()
    return console if console.is_terminal else Console(width=NOT_A_TERMINAL_WIDTH)


def run_status_command(db: Path, *, now_s: int | None = None, console: Console | None = None,
                       routing: Mapping[str, float] = ROUTING_VARIABLES) -> int:
    """Print the screen; 1 with a one-line reason when `db` is not a read model."""
    console = console or _stdout_console()
    if not db.is_file():
        _refuse(f"no read model at {db} (run `hearth projector --db {db}`)")
        return 1
    connection = open_read_only(db)
    try:
        tables = status_tables(connection, int(time.time()) if now_s is None else now_s, routing)
    except sqlite3.DatabaseError as error:  # tables missing, or no SQLite database at all (OperationalError's base)
        _refuse(f"{db} is not a migrated read model ({error})")
        return 1
    finally:
        connection.close()
    for table in tables:
        console.print(table)
    return 0

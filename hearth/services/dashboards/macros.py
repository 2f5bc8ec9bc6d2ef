"""Expands a panel's SQL exactly as Grafana's SQLite plugin (frser-sqlite-datasource) does before running it.

The plugin (pkg/plugin/variables.go, macros.go) first replaces `$__from` and `$__to` with the time range in
epoch milliseconds, then each `$__name(args)` macro: `$__timeFilter(col)` becomes a BETWEEN on epoch seconds
(numbers as they are, strings through strftime), `$__unixEpochGroupSeconds(col, n)` becomes
`cast((col / n) as int) * n`; other macros are left as written. Grafana itself replaces the dashboard's
variables (`${name}`: the routing settings of routing_sql.ROUTING_VARIABLES) before the plugin sees the query.
Tests, the PNG renders, `hearth status` and the benchmark run panel SQL through this, so what they measure is
what Grafana sends to SQLite.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass

from hearth.services.dashboards.routing_sql import ROUTING_VARIABLES

_MACRO = re.compile(r"\$__([_a-zA-Z0-9]+)\(([^\)]*)\)")
_VARIABLE = re.compile(r"\$\{([_a-zA-Z0-9]+)\}")


@dataclass(frozen=True)
class TimeRange:
    """A dashboard's time range in whole epoch seconds (Grafana's plugin uses Unix() seconds)."""

    from_s: int
    to_s: int


def expand(sql: str, time_range: TimeRange, variables: Mapping[str, float] = ROUTING_VARIABLES) -> str:
    """`sql` with the dashboard's `variables` (numbers; an unknown one is left as written, as Grafana leaves it) and
    the plugin's variables and macros replaced for `time_range`."""
    sql = _VARIABLE.sub(lambda match: f"{float(variables[match[1]]):g}" if match[1] in variables else match[0], sql)
    sql = sql.replace("$__from", str(time_range.from_s * 1000)).replace("$__to", str(time_range.to_s * 1000))
    return _MACRO.sub(lambda match: _macro(match, time_range), sql)


def _macro(match: re.Match, time_range: TimeRange) -> str:
    name, arguments = match[1], match[2].split(",")
    if name == "timeFilter":
        if len(arguments) != 1:
            raise ValueError(f"unsupported number of arguments ({len(arguments)}) for timeFilter")
        column = arguments[0]
        return (f"CAST(CASE WHEN typeof({column}) = 'integer' THEN {column} ELSE strftime(\"%s\", {column}) END "
                f"AS INTEGER) BETWEEN {time_range.from_s} AND {time_range.to_s}")
    if name == "unixEpochGroupSeconds":
        if not 2 <= len(arguments) <= 3:
            raise ValueError(f"unsupported number of arguments ({len(arguments)}) for unixEpochGroupSeconds")
        interval = int(arguments[1].strip())
        return f"cast(({arguments[0]} / {interval}) as int) * {interval}"
    return match[0]


def run_panel_sql(connection: sqlite3.Connection, sql: str, time_range: TimeRange,
                  variables: Mapping[str, float] = ROUTING_VARIABLES) -> tuple[list[str], list[tuple]]:
    """Column names and rows of a panel's query on an open read-model connection."""
    cursor = connection.execute(expand(sql, time_range, variables))
    try:
        return [description[0] for description in cursor.description], cursor.fetchall()
    finally:
        cursor.close()

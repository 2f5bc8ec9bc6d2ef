"""The rows one projection batch touches: each loaded once, edited as a plain dict, written back in one executemany.

Handlers do not talk SQL: they edit the dict rows a `BatchRows` holds, and `flush()` writes every changed row back
whole (an upsert) with one executemany per table. That keeps a heartbeat at a few microseconds instead of two SQL
statements. A row that exists is updated where it stands (ON CONFLICT DO UPDATE), not deleted and inserted again as
INSERT OR REPLACE would: its key index is left as it is, so a heartbeat writes one page per row it changes instead of
two (an idle mesh's read models take mostly heartbeats: BENCHMARKS.md, "An idle mesh"). All SQL runs on the session's
own DB-API connection, inside the caller's transaction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Table
from sqlalchemy.orm import Session

from hearth.readmodels.tables import (
    AppliedEvent,
    EventCount,
    Failover,
    HostTokensDaily,
    IntegrityEvidence,
    KeptPrefixRecord,
    MemberAddition,
    MemberKey,
    MemberRemoval,
    Pipeline,
    RejectedEvent,
    RejectedEventCount,
    Shard,
    ShardHealth,
    ShardReputation,
    ShardStats,
    StewardKey,
)

SHARDS: Table = Shard.__table__
SHARD_HEALTH: Table = ShardHealth.__table__
SHARD_STATS: Table = ShardStats.__table__
PIPELINES: Table = Pipeline.__table__
FAILOVERS: Table = Failover.__table__
REJECTED_EVENTS: Table = RejectedEvent.__table__
REJECTED_EVENT_COUNTS: Table = RejectedEventCount.__table__
EVENT_COUNTS: Table = EventCount.__table__
HOST_TOKENS_DAILY: Table = HostTokensDaily.__table__
SHARD_REPUTATION: Table = ShardReputation.__table__
INTEGRITY_EVIDENCE: Table = IntegrityEvidence.__table__
KEPT_PREFIXES: Table = KeptPrefixRecord.__table__
MEMBER_REMOVALS: Table = MemberRemoval.__table__
STEWARD_KEYS: Table = StewardKey.__table__
MEMBER_KEYS: Table = MemberKey.__table__
MEMBER_ADDITIONS: Table = MemberAddition.__table__
APPLIED_EVENTS: Table = AppliedEvent.__table__

Row = dict[str, Any]


# Keys looked up per query by BatchRows.preload: three key columns stay within the 999 parameters of an older SQLite.
preload_chunk_keys = 300

# The most a count a read model sums over events holds: sums stop there (saturating_add), well inside SQLite's 64-bit
# INTEGER, so no number of events, each within the events' own bounds, can make a row unwritable.
max_summed_count = 2**62


def saturating_add(total: int, amount: int) -> int:
    """`total + amount`, but never past max_summed_count."""
    return min(total + amount, max_summed_count)


def epoch_s(instant: datetime) -> int:
    """Floor to whole epoch seconds (the read models' INTEGER timestamp convention)."""
    return math.floor(instant.timestamp())


def session_cursor(session: Session):
    """A DB-API cursor on the session's own connection, so reads and writes share its transaction."""
    return session.connection().connection.cursor()


class TableSql:
    """Prebuilt SQL for one table: load a row by primary key, write rows back whole."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.columns = [column.name for column in table.columns]
        self.key_columns = [column.name for column in table.primary_key.columns]
        where = " AND ".join(f"{name} = ?" for name in self.key_columns)
        self.select_one = f"SELECT {', '.join(self.columns)} FROM {table.name} WHERE {where}"
        placeholders = ", ".join("?" for _ in self.columns)
        # Every write carries the whole row; the primary key is each table's only unique constraint.
        updates = ", ".join(f"{name} = excluded.{name}" for name in self.columns if name not in self.key_columns)
        self.upsert = (
            f"INSERT INTO {table.name} ({', '.join(self.columns)}) VALUES ({placeholders}) "
            f"ON CONFLICT ({', '.join(self.key_columns)}) DO {f'UPDATE SET {updates}' if updates else 'NOTHING'}"
        )


TABLE_SQL = {
    table.name: TableSql(table)
    for table in (SHARDS, SHARD_HEALTH, SHARD_STATS, PIPELINES, FAILOVERS, REJECTED_EVENTS, REJECTED_EVENT_COUNTS,
                  EVENT_COUNTS, HOST_TOKENS_DAILY, SHARD_REPUTATION, INTEGRITY_EVIDENCE, KEPT_PREFIXES,
                  MEMBER_REMOVALS, STEWARD_KEYS, MEMBER_KEYS, MEMBER_ADDITIONS, APPLIED_EVENTS)
}


class BatchRows:
    """The rows one batch touches: each loaded at most once, edited in memory, written back by `flush()`."""

    def __init__(self, session: Session) -> None:
        self._cursor = session_cursor(session)
        self._rows: dict[str, dict[Any, Row | None]] = {name: {} for name in TABLE_SQL}
        self._dirty: dict[str, dict[Any, Row]] = {name: {} for name in TABLE_SQL}
        # Each row's values as the database holds them (column order), as read or last written: a dirty row equal to
        # them is not written (an idle shard's heartbeat leaves its shard_stats row as it was).
        self._stored: dict[str, dict[Any, tuple]] = {name: {} for name in TABLE_SQL}
        # The signers whose kept-prefix records the batch brought: their expired ones are pruned after flush.
        self.kept_prefix_signers: set[str] = set()

    @property
    def cursor(self):
        """The batch's cursor, for bookkeeping that runs after `flush()` in the same transaction."""
        return self._cursor

    def get(self, table: Table, key: Any) -> Row | None:
        """The current row (None if there is none); edit it only through `edit` or `put`."""
        rows = self._rows[table.name]
        if key not in rows:
            sql = TABLE_SQL[table.name]
            self._cursor.execute(sql.select_one, key if isinstance(key, tuple) else (key,))
            found = self._cursor.fetchone()
            rows[key] = dict(zip(sql.columns, found)) if found is not None else None
            if found is not None:
                self._stored[table.name][key] = tuple(found)
        return rows[key]

    def preload(self, table: Table, keys: Iterable[Any]) -> None:
        """Load the rows of many keys at once, a query per `preload_chunk_keys` rather than one per key; a key without
        a row is then held as None, so `get` of it asks the database nothing."""
        sql = TABLE_SQL[table.name]
        rows = self._rows[table.name]
        missing = [key for key in dict.fromkeys(keys) if key not in rows]
        width = len(sql.key_columns)
        one_key = "(" + ", ".join("?" * width) + ")"
        # CROSS JOIN: the listed keys drive, each a search of the primary key (a row-value IN would scan the table).
        on = " AND ".join(f"t.{name} = v.column{i + 1}" for i, name in enumerate(sql.key_columns))
        columns = ", ".join(f"t.{name}" for name in sql.columns)
        for start in range(0, len(missing), preload_chunk_keys):
            chunk = missing[start:start + preload_chunk_keys]
            rows.update(dict.fromkeys(chunk))
            self._cursor.execute(
                f"SELECT {columns} FROM (VALUES {', '.join([one_key] * len(chunk))}) AS v CROSS JOIN {table.name} AS t "
                f"ON {on}", [part for key in chunk for part in (key if width > 1 else (key,))])
            for found in self._cursor.fetchall():
                row = dict(zip(sql.columns, found))
                key = tuple(row[name] for name in sql.key_columns)
                rows[key if width > 1 else key[0]] = row
                self._stored[table.name][key if width > 1 else key[0]] = tuple(found)

    def where(self, table: Table, column: str, value: Any) -> list[Row]:
        """Every current row whose `column` is `value`: the stored ones loaded into the batch (a row it already
        holds stays as edited), then all the batch holds that match, its own edits and new rows included."""
        sql = TABLE_SQL[table.name]
        if column not in sql.columns:
            raise ValueError(f"{table.name} has no column {column}")
        rows = self._rows[table.name]
        self._cursor.execute(f"SELECT {', '.join(sql.columns)} FROM {table.name} WHERE {column} = ?", (value,))
        for found in self._cursor.fetchall():
            row = dict(zip(sql.columns, found))
            key = tuple(row[name] for name in sql.key_columns)
            key = key if len(key) > 1 else key[0]
            if key not in rows:
                rows[key] = row
                self._stored[table.name][key] = tuple(found)
        return [row for row in rows.values() if row is not None and row[column] == value]

    def edit(self, table: Table, key: Any, new_row: Callable[[], Row] | None = None) -> Row | None:
        """The row to change in place: created with `new_row()` if missing (None without a factory)."""
        row = self.get(table, key)
        if row is None:
            if new_row is None:
                return None
            row = new_row()
            self._rows[table.name][key] = row
        self._dirty[table.name][key] = row
        return row

    def put(self, table: Table, key: Any, row: Row) -> None:
        """Replace the whole row (no need to load it first)."""
        self._rows[table.name][key] = row
        self._dirty[table.name][key] = row

    def flush(self) -> list[Row]:
        """Write every changed row back; returns the pipelines rows written (for the per-minute rollups)."""
        pipelines = list(self._dirty[PIPELINES.name].values())
        for name, dirty in self._dirty.items():
            if dirty:
                sql, stored = TABLE_SQL[name], self._stored[name]
                changed = {key: values for key, row in dirty.items()
                           if (values := tuple(row[column] for column in sql.columns)) != stored.get(key)}
                self._cursor.executemany(sql.upsert, changed.values())
                stored.update(changed)
                dirty.clear()
        return pipelines

    def close(self) -> None:
        self._cursor.close()

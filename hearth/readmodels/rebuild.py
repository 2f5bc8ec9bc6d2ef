"""Rebuilds a read-model database from the whole event log and diffs two read-model databases row by row.

`rebuild_database` is the proof that the read model is only a cache of the log: a fresh file, migrated by
Alembic, fed every stored message of both streams through the same projection the live projector uses, then
pruned by the same retention policy (readmodels.retention), so it holds what a live projector's pruning leaves.
`diff_databases(new, live)` then lists every row that differs, is missing from live or is extra in live,
per table; `diff_within_log` leaves out the rows older than the log's window (readmodels.log_window), which a
live read model keeps from events the streams have since dropped and no rebuild can make. `projection_positions`
and `applied_events` are left out by default: they record how far each file has read and what it applied, not what
the log says, and a live database that kept running after the rebuild is legitimately ahead; compare them with
`include_positions=True` (a live projector that is ahead explains differences in rows touched by the newer events).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select, text
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import sessionmaker

from hearth.events.consume import SkippedMessage, StoredEvent, read_stream
from hearth.events.signing import EventVerifier, RejectionReason
from hearth.events.streams import ALL_STREAMS
from hearth.readmodels.db import ReadModelUnusable, damaged_file, open_engine, unversioned_file, upgrade_database
from hearth.readmodels.log_window import compared_columns, keys_older_than_log, window_start
from hearth.readmodels.positions import record_stream_identity
from hearth.readmodels.projection import PROJECTION_NAME, ReadModelProjection
from hearth.readmodels.retention import RetentionPolicy, prune_all
from hearth.readmodels.stream_identity import stream_state
from hearth.readmodels.tables import AppliedEvent, Base, ProjectionPosition
from hearth.readmodels.unapplicable import apply_rejecting_the_unapplicable

log = logging.getLogger(__name__)

rebuild_batch_events = 5_000
# Where a rebuild writes until it is whole (beside the file it makes), and the files SQLite keeps for one database.
partial_suffix = ".partial"
_SQLITE_COMPANIONS = ("", "-wal", "-shm")
# What a file records of its own reading, not what the log says: positions, and the ids of the events it applied (a file
# migrated from before applied_events knows none of the ids it applied then).
_BOOKKEEPING_TABLES = frozenset({ProjectionPosition.__tablename__, AppliedEvent.__tablename__})


async def rebuild_database(
    js: Any,
    db_path: str | Path,
    *,
    overwrite: bool = False,
    streams: Iterable[str] = ALL_STREAMS,
    projection_name: str = PROJECTION_NAME,
    batch_events: int = rebuild_batch_events,
    verifier: EventVerifier | None = None,
    retention: RetentionPolicy | None = None,
    window: dict[str, int] | None = None,
) -> int:
    """Create a fresh read model at `db_path` from every message the streams hold now; returns how many
    messages were applied. Refuses an existing file unless `overwrite` (which it replaces). Give the
    `verifier` and the `retention` the live projector uses, or the rows differ from its. A `window` given is filled
    with, per stream that dropped messages, where what it still holds starts (log_window.window_start).

    It is built beside `db_path` and moved there once whole: a rebuild that fails (a full disk, the broker gone, a
    stop) leaves no half read model that reads as a whole one, and keeps the file it was to replace."""
    path = Path(db_path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; a rebuild writes a fresh database (pass overwrite=True)")
    partial = path.with_name(path.name + partial_suffix)
    _remove_database_files(partial)
    try:
        applied = await _rebuild_into(js, partial, streams, projection_name, batch_events, verifier, retention, window)
        _move_database_files(partial, path)
    except BaseException:
        _remove_database_files(partial)
        raise
    log.info("rebuilt %s from %d messages", path, applied)
    return applied


def _move_database_files(source: Path, target: Path) -> None:
    for companion in reversed(_SQLITE_COMPANIONS):  # journals first: one beside either file belongs to it alone
        finished, replaced = source.with_name(source.name + companion), target.with_name(target.name + companion)
        if finished.exists():
            finished.replace(replaced)
        else:
            replaced.unlink(missing_ok=True)


async def _rebuild_into(js: Any, path: Path, streams: Iterable[str], projection_name: str, batch_events: int,
                        verifier: EventVerifier | None, retention: RetentionPolicy | None,
                        window: dict[str, int] | None) -> int:
    await asyncio.to_thread(upgrade_database, path)
    engine = open_engine(path)
    session_factory = sessionmaker(engine)
    projection = ReadModelProjection(projection_name, verifier=verifier, retention=retention)

    def apply_transaction(batch: Sequence[StoredEvent | SkippedMessage], reject_as: RejectionReason | None
                          ) -> list[int]:
        with session_factory() as session, session.begin():
            return [projection.apply_many(session, batch, reject_as=reject_as)]

    def apply(batch: list[StoredEvent | SkippedMessage]) -> int:
        return sum(apply_rejecting_the_unapplicable(apply_transaction, batch, projection=projection.name))

    def record(stream: str, created: str) -> None:
        with session_factory() as session, session.begin():
            record_stream_identity(session, projection.name, stream, created)

    applied = 0
    pending: asyncio.Future[int] | None = None
    try:
        for stream in streams:
            # Which stream the positions are taken in, as a live projector records it (readmodels.stream_identity).
            state = await stream_state(js, stream)
            created = state.created
            first: StoredEvent | SkippedMessage | None = None
            batch: list[StoredEvent | SkippedMessage] = []
            async for message in read_stream(js, stream, from_seq=1, follow=False):
                if first is None:
                    first = message
                batch.append(message)
                if len(batch) >= batch_events:
                    # Read the next batch while this one is written.
                    if pending is not None:
                        applied += await pending
                    pending = asyncio.ensure_future(asyncio.to_thread(apply, batch))
                    batch = []
            if pending is not None:
                applied += await pending
                pending = None
            if batch:
                applied += await asyncio.to_thread(apply, batch)
            if created is not None:
                await asyncio.to_thread(record, stream, created)
            start = window_start(first, state.last_seq)
            if window is not None and start is not None:
                window[stream] = start
        if retention is not None:
            await asyncio.to_thread(prune_all, session_factory, retention, projection.name)
    finally:
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        engine.dispose()
    return applied


def _remove_database_files(path: Path) -> None:
    for companion in _SQLITE_COMPANIONS:
        path.with_name(path.name + companion).unlink(missing_ok=True)


@dataclass(frozen=True)
class RowDifference:
    """One row that differs between a rebuilt database (`new`, what the log says) and a `live` one."""

    table: str
    key: dict[str, Any]
    kind: Literal["changed", "missing_in_live", "extra_in_live"]
    new_row: dict[str, Any] | None = None
    live_row: dict[str, Any] | None = None
    columns: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        key = ", ".join(f"{name}={value!r}" for name, value in self.key.items())
        where = f"{self.table}[{key}]"
        if self.kind == "missing_in_live":
            return f"{where}: missing in live (the log gives {_brief(self.new_row)})"
        if self.kind == "extra_in_live":
            return f"{where}: extra in live, the log has no such row ({_brief(self.live_row)})"
        changes = "; ".join(
            f"{column}: live {self.live_row[column]!r}, log {self.new_row[column]!r}"
            for column in self.columns
        )
        return f"{where}: {changes}"


def _brief(row: dict[str, Any] | None, limit: int = 6) -> str:
    items = list((row or {}).items())
    shown = ", ".join(f"{name}={value!r}" for name, value in items[:limit])
    return shown + (", …" if len(items) > limit else "")


# Columns no projection of the log writes: the stream a position was taken in is recorded by whichever process
# looked at the broker, when it looked (readmodels.stream_identity). And bookkeeping that tells copies, no figure: the
# heartbeat a shard_health row states is NULL in a row written before migration 0019 (readmodels.applied_events).
UNCOMPARED_COLUMNS: dict[str, tuple[str, ...]] = {"projection_positions": ("stream_created",),
                                                  "shard_health": ("heartbeat_id",)}


@dataclass(frozen=True)
class LogDiff:
    """The rows that differ within the log's window, and how many rows of each side were left out as older."""

    differences: list[RowDifference]
    window: Mapping[str, int]
    left_out_new: int
    left_out_live: int

    def window_lines(self, new_name: object, live_name: object) -> list[str]:
        """Where each stream's window starts and how many rows were left out, one line each (none: nothing dropped)."""
        lines = [f"{stream} holds messages from {datetime.fromtimestamp(start, timezone.utc):%Y-%m-%d %H:%M:%S} UTC on"
                 for stream, start in self.window.items()]
        if self.window:
            lines.append(f"left out as older than the log: {self.left_out_new} rows of {new_name}, "
                         f"{self.left_out_live} rows of {live_name}")
        return lines


def diff_databases(
    new_path: str | Path, live_path: str | Path, *, include_positions: bool = False
) -> list[RowDifference]:
    """Every row that differs between two read-model databases, per table, ordered by table and key;
    ReadModelUnusable when either is damaged, holds no schema revision, or their schema revisions differ."""
    return diff_within_log(new_path, live_path, {}, include_positions=include_positions).differences


def diff_within_log(
    new_path: str | Path, live_path: str | Path, window: Mapping[str, int], *, include_positions: bool = False
) -> LogDiff:
    """`diff_databases`, leaving out on both sides every key whose row, on either side, began before the `window`
    of its stream (per stream that dropped messages, where what it holds starts: rebuild_database fills it)."""
    for path in (new_path, live_path):
        if not Path(path).is_file():
            raise FileNotFoundError(f"no read-model database at {path}")
    new_engine, live_engine = open_engine(new_path), open_engine(live_path)
    try:
        new_version, live_version = _schema_version(new_engine), _schema_version(live_engine)
        for path, version in ((new_path, new_version), (live_path, live_version)):
            if version is None:
                raise unversioned_file(path)
        if new_version != live_version:
            raise ReadModelUnusable(
                f"schema versions differ ({new_path}: {new_version}, {live_path}: {live_version}); "
                "migrate both to the same revision first"
            )
        differences: list[RowDifference] = []
        left_out_new = left_out_live = 0
        for table in Base.metadata.sorted_tables:
            if table.name in _BOOKKEEPING_TABLES and not include_positions:
                continue
            key_columns = [column.name for column in table.primary_key.columns]
            new_rows = _rows_by_key(new_engine, table, key_columns)
            live_rows = _rows_by_key(live_engine, table, key_columns)
            older = _keys_older_than_log(new_engine, table.name, key_columns, window) | _keys_older_than_log(
                live_engine, table.name, key_columns, window)
            left_out_new += len(older & new_rows.keys())
            left_out_live += len(older & live_rows.keys())
            new_rows = {key: row for key, row in new_rows.items() if key not in older}
            live_rows = {key: row for key, row in live_rows.items() if key not in older}
            for key in sorted(new_rows.keys() | live_rows.keys(), key=_sortable):
                new_row, live_row = new_rows.get(key), live_rows.get(key)
                key_dict = dict(zip(key_columns, key))
                if live_row is None:
                    differences.append(
                        RowDifference(table.name, key_dict, "missing_in_live", new_row=new_row)
                    )
                elif new_row is None:
                    differences.append(
                        RowDifference(table.name, key_dict, "extra_in_live", live_row=live_row)
                    )
                elif columns := compared_columns(table.name, new_row, live_row):
                    differences.append(
                        RowDifference(table.name, key_dict, "changed", new_row=new_row, live_row=live_row,
                                      columns=columns)
                    )
        return LogDiff(differences, dict(window), left_out_new, left_out_live)
    finally:
        new_engine.dispose()
        live_engine.dispose()


def _schema_version(engine) -> str | None:
    with engine.connect() as connection:
        try:
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except Exception:
            return None


def _keys_older_than_log(engine, table: str, key_columns: list[str], window: Mapping[str, int]) -> set[tuple]:
    with engine.connect() as connection:
        return keys_older_than_log(connection, table, key_columns, window)


def _rows_by_key(engine, table, key_columns: list[str]) -> dict[tuple, dict[str, Any]]:
    uncompared = UNCOMPARED_COLUMNS.get(table.name, ())
    with engine.connect() as connection:
        try:
            rows = connection.execute(select(table)).mappings()
            return {tuple(row[name] for name in key_columns): {name: value for name, value in row.items()
                                                               if name not in uncompared} for row in rows}
        except DatabaseError as error:
            if (damaged := damaged_file(engine.url.database, error)) is not None:
                raise damaged from None
            raise


def _sortable(key: tuple) -> tuple:
    return tuple((value is None, str(type(value)), value if value is not None else 0) for value in key)

"""Projects stored events into the read-model rows, exactly once: rows and stream position commit together.

`ReadModelProjection.apply_many(session, messages)` runs inside the caller's transaction: for each message
whose sequence is beyond its stream's stored position it runs the handler of its event class (one small
method per type, dispatched with functools.singledispatchmethod) and then moves that stream's position
forward; messages at or below the position (redeliveries, a replay over an up-to-date database) are no-ops.
The caller commits once, so a crash between two batches leaves rows and positions consistent.

Handlers do not talk SQL: they edit plain dict rows held by a `BatchRows` unit of work, which loads each
touched row once per batch and writes every changed row back with one executemany per table, then the
positions. That keeps a heartbeat at a few microseconds instead of two SQL statements.

Determinism: every stored value comes from the event (instants from `occurred_at`, never the wall clock),
each table column is written from one stream only, and rows are keyed on the payload (shard_id,
pipeline_id), so deleting the database and replaying the log gives the same rows whatever the
interleaving of the two streams. Two caveats that come from the log's retention, not from this code:
heartbeats are capped per subject and events age out (7/30 days), so counters over trimmed history
(pipelines_joined, ...) can only be rebuilt from what the log still holds. The latest heartbeat survives
trimming, which is why shard_health and shard_stats.tokens_served keep only latest values.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table
from sqlalchemy.orm import Session

from events.models import (
    EventEnvelope,
    IntegrityCorruptionDetected,
    PipelineAborted,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
    ShardAdvertised,
    ShardHeartbeat,
    ShardWithdrawn,
)
from readmodels.tables import Failover, Pipeline, ProjectionPosition, Shard, ShardHealth, ShardStats

if TYPE_CHECKING:
    from events.consume import SkippedMessage, StoredEvent

log = logging.getLogger(__name__)

PROJECTION_NAME = "readmodels"

TERMINAL_PIPELINE_STATUSES = frozenset({"completed", "aborted"})

SHARDS: Table = Shard.__table__
SHARD_HEALTH: Table = ShardHealth.__table__
SHARD_STATS: Table = ShardStats.__table__
PIPELINES: Table = Pipeline.__table__
FAILOVERS: Table = Failover.__table__
POSITIONS: Table = ProjectionPosition.__table__

Row = dict[str, Any]


class ConcurrentProjectionError(RuntimeError):
    """Another writer moved this projection's position during our transaction; the batch was not applied."""


def epoch_s(instant: datetime) -> int:
    """Floor to whole epoch seconds (the read models' INTEGER timestamp convention)."""
    return math.floor(instant.timestamp())


def load_positions(session: Session, projection: str = PROJECTION_NAME) -> dict[str, int]:
    """The last applied sequence per stream (streams never applied are absent)."""
    cursor = _dbapi_cursor(session)
    try:
        cursor.execute(f"SELECT stream, last_seq FROM {POSITIONS.name} WHERE projection = ?", (projection,))
        return dict(cursor.fetchall())
    finally:
        cursor.close()


def _dbapi_cursor(session: Session):
    # The session's own connection, so reads and writes share its transaction.
    return session.connection().connection.cursor()


class _TableSql:
    """Prebuilt SQL for one table: load a row by primary key, write rows back whole."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.columns = [column.name for column in table.columns]
        self.key_columns = [column.name for column in table.primary_key.columns]
        where = " AND ".join(f"{name} = ?" for name in self.key_columns)
        self.select_one = f"SELECT {', '.join(self.columns)} FROM {table.name} WHERE {where}"
        placeholders = ", ".join("?" for _ in self.columns)
        # Every write carries the whole row, so REPLACE is an upsert (no foreign keys point at these rows).
        self.replace = (
            f"INSERT OR REPLACE INTO {table.name} ({', '.join(self.columns)}) VALUES ({placeholders})"
        )


_TABLE_SQL = {
    table.name: _TableSql(table) for table in (SHARDS, SHARD_HEALTH, SHARD_STATS, PIPELINES, FAILOVERS)
}


class BatchRows:
    """The rows one batch touches: each loaded at most once, edited in memory, written back by `flush()`."""

    def __init__(self, session: Session) -> None:
        self._cursor = _dbapi_cursor(session)
        self._rows: dict[str, dict[Any, Row | None]] = {name: {} for name in _TABLE_SQL}
        self._dirty: dict[str, dict[Any, Row]] = {name: {} for name in _TABLE_SQL}

    def get(self, table: Table, key: Any) -> Row | None:
        """The current row (None if there is none); edit it only through `edit` or `put`."""
        rows = self._rows[table.name]
        if key not in rows:
            sql = _TABLE_SQL[table.name]
            self._cursor.execute(sql.select_one, key if isinstance(key, tuple) else (key,))
            found = self._cursor.fetchone()
            rows[key] = dict(zip(sql.columns, found)) if found is not None else None
        return rows[key]

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

    def flush(self) -> None:
        for name, dirty in self._dirty.items():
            if dirty:
                sql = _TABLE_SQL[name]
                values = [tuple(row[column] for column in sql.columns) for row in dirty.values()]
                self._cursor.executemany(sql.replace, values)
                dirty.clear()

    def close(self) -> None:
        self._cursor.close()


def _new_stats(shard_id: str) -> Callable[[], Row]:
    return lambda: dict(
        shard_id=shard_id, tokens_served=0, pipelines_joined=0, failovers_caused=0, corruption_detections=0
    )


class ReadModelProjection:
    """Event handlers for the read-model tables plus the position bookkeeping that makes them exactly once."""

    def __init__(self, name: str = PROJECTION_NAME) -> None:
        self.name = name

    # ---- applying messages -------------------------------------------------------------------------------

    def apply(self, session: Session, message: StoredEvent | SkippedMessage) -> bool:
        """Apply one message in the session's transaction (the caller commits); False if applied before."""
        return self.apply_many(session, (message,)) == 1

    def apply_many(self, session: Session, messages: Iterable[StoredEvent | SkippedMessage]) -> int:
        """Apply messages (any mix of streams, each stream in sequence order) inside the session's current
        transaction, then write each touched stream's new position in that same transaction.

        Returns how many messages moved a position (skipped, undecodable ones included). The caller commits;
        if it rolls back instead, neither rows nor positions change.
        """
        stored_positions = load_positions(session, self.name)
        positions = dict(stored_positions)
        last_event_at: dict[str, int] = {}
        applied = 0
        rows = BatchRows(session)
        try:
            for message in messages:
                if message.seq <= positions.get(message.stream, 0):
                    continue
                event = getattr(message, "event", None)
                if event is None:
                    log.warning(
                        "%s: skipping undecodable message %s #%d on %s: %s",
                        self.name, message.stream, message.seq, message.subject, message.error,
                    )
                else:
                    self.handle(event, rows)
                positions[message.stream] = message.seq
                last_event_at[message.stream] = epoch_s(message.time)
                applied += 1
            rows.flush()
        finally:
            rows.close()
        for stream, at in last_event_at.items():
            self._save_position(session, stream, stored_positions.get(stream), positions[stream], at)
        return applied

    def _save_position(
        self, session: Session, stream: str, previous_seq: int | None, last_seq: int, last_event_at: int
    ) -> None:
        cursor = _dbapi_cursor(session)
        try:
            if previous_seq is None:
                # A concurrent first insert fails on the primary key, rolling our batch back.
                cursor.execute(
                    f"INSERT INTO {POSITIONS.name} (projection, stream, last_seq, last_event_at) "
                    "VALUES (?, ?, ?, ?)",
                    (self.name, stream, last_seq, last_event_at),
                )
                return
            # Guarded by the value we read: if another projector advanced it meanwhile, nothing matches.
            cursor.execute(
                f"UPDATE {POSITIONS.name} SET last_seq = ?, last_event_at = ? "
                "WHERE projection = ? AND stream = ? AND last_seq = ?",
                (last_seq, last_event_at, self.name, stream, previous_seq),
            )
            if cursor.rowcount != 1:
                raise ConcurrentProjectionError(
                    f"projection {self.name!r} position of {stream} moved under us (expected {previous_seq})"
                )
        finally:
            cursor.close()

    # ---- one handler per event type ---------------------------------------------------------------------

    @singledispatchmethod
    def handle(self, event: EventEnvelope, rows: BatchRows) -> None:
        """Events without a handler change no rows (their position still advances)."""
        log.debug("%s: no read-model handler for %s", self.name, type(event).__name__)

    @handle.register
    def _shard_advertised(self, event: ShardAdvertised, rows: BatchRows) -> None:
        rows.put(SHARDS, event.shard_id, dict(
            shard_id=event.shard_id,
            model_id=event.model_id,
            weights_sha256=event.weights_sha256,
            node_id=event.node_id,
            layer_lo=event.layer_lo,
            layer_hi=event.layer_hi,
            total_layers=event.total_layers,
            dtype=event.dtype,
            memory_required_mb=event.memory_required_mb,
            max_concurrent_streams=event.max_concurrent_streams,
            control_subject=event.control_subject,
            hop_weight=event.hop_weight,
            ttl_s=event.ttl_s,
            status="advertised",
            advertised_at=epoch_s(event.occurred_at),
            expires_at=math.floor(event.occurred_at.timestamp() + event.ttl_s),
            withdrawn_at=None,
            withdrawn_reason=None,
        ))

    @handle.register
    def _shard_heartbeat(self, event: ShardHeartbeat, rows: BatchRows) -> None:
        rows.put(SHARD_HEALTH, event.shard_id, dict(
            shard_id=event.shard_id,
            last_seen=epoch_s(event.occurred_at),
            queue_depth=event.queue_depth,
            active_streams=event.active_streams,
            p95_latency_ms=event.p95_latency_ms,
            tokens_served_total=event.tokens_served_total,
        ))
        rows.edit(SHARD_STATS, event.shard_id, _new_stats(event.shard_id))["tokens_served"] = (
            event.tokens_served_total
        )

    @handle.register
    def _shard_withdrawn(self, event: ShardWithdrawn, rows: BatchRows) -> None:
        # A withdrawal whose advertisement aged out of the log has no row to mark; nothing to route anyway.
        shard = rows.edit(SHARDS, event.shard_id)
        if shard is not None:
            shard.update(
                status="withdrawn", withdrawn_at=epoch_s(event.occurred_at), withdrawn_reason=event.reason
            )

    @handle.register
    def _pipeline_constructed(self, event: PipelineConstructed, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        newly_joined = [shard_id for shard_id in dict.fromkeys(event.hops) if shard_id not in _hops(pipeline)]
        pipeline.update(
            request_id=event.request_id,
            model_id=event.model_id,
            weights_sha256=event.weights_sha256,
            orchestrator_node_id=event.node_id,
            construct_ms=event.construct_ms,
            constructed_at=epoch_s(event.occurred_at),
            hops=json.dumps(list(event.hops)),
        )
        _set_live_status(pipeline)
        self._count(rows, newly_joined, "pipelines_joined")

    @handle.register
    def _pipeline_first_token(self, event: PipelineFirstToken, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        pipeline.update(ttft_ms=event.ttft_ms, first_token_at=epoch_s(event.occurred_at))
        _set_live_status(pipeline)

    @handle.register
    def _pipeline_shard_status(self, event: PipelineShardStatus, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        pipeline.update(last_shard_status=event.status, last_shard_status_shard_id=event.shard_id)
        _set_live_status(pipeline, degraded=event.status == "degraded")

    @handle.register
    def _pipeline_failover(self, event: PipelineFailover, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        current_hops = _hops(pipeline)
        pipeline["failovers"] += 1
        rows.put(FAILOVERS, (event.pipeline_id, pipeline["failovers"]), dict(
            pipeline_id=event.pipeline_id,
            n=pipeline["failovers"],
            failed_shard_id=event.failed_shard_id,
            replacement_hops=json.dumps(list(event.replacement_hops)),
            reason=event.reason,
            resumed_at_token=event.resumed_at_token,
            occurred_at=epoch_s(event.occurred_at),
        ))
        new_hops = hops_after_failover(current_hops, event.failed_shard_id, event.replacement_hops)
        pipeline["hops"] = json.dumps(new_hops)
        _set_live_status(pipeline)
        newly_joined = [s for s in dict.fromkeys(event.replacement_hops) if s not in current_hops]
        self._count(rows, newly_joined, "pipelines_joined")
        self._count(rows, [event.failed_shard_id], "failovers_caused")

    @handle.register
    def _pipeline_fallback_local(self, event: PipelineFallbackLocal, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        pipeline.update(fell_back_to_local=1, fallback_reason=event.reason)
        if pipeline["status"] not in TERMINAL_PIPELINE_STATUSES:
            pipeline["status"] = "fallback_local"

    @handle.register
    def _pipeline_completed(self, event: PipelineCompleted, rows: BatchRows) -> None:
        self._pipeline(rows, event).update(
            status="completed",
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            duration_ms=event.duration_ms,
            tokens_per_second=event.tokens_per_second,
            finish_reason=event.finish_reason,
            finished_at=epoch_s(event.occurred_at),
        )

    @handle.register
    def _pipeline_aborted(self, event: PipelineAborted, rows: BatchRows) -> None:
        self._pipeline(rows, event).update(
            status="aborted",
            error_code=event.code,
            error_reason=event.reason,
            finished_at=epoch_s(event.occurred_at),
        )

    @handle.register
    def _corruption_detected(self, event: IntegrityCorruptionDetected, rows: BatchRows) -> None:
        self._count(rows, [event.shard_id], "corruption_detections")

    # ---- helpers -----------------------------------------------------------------------------------------

    @staticmethod
    def _pipeline(rows: BatchRows, event: Any) -> Row:
        """The pipeline row of this event, created if an earlier event of it has aged out of the log."""

        def new_pipeline() -> Row:
            row: Row = {column: None for column in _TABLE_SQL[PIPELINES.name].columns}
            row.update(
                pipeline_id=event.pipeline_id,
                orchestrator_node_id=event.node_id,
                status="constructed",
                hops="[]",
                failovers=0,
                fell_back_to_local=0,
            )
            return row

        pipeline = rows.edit(PIPELINES, event.pipeline_id, new_pipeline)
        pipeline["updated_at"] = epoch_s(event.occurred_at)
        return pipeline

    @staticmethod
    def _count(rows: BatchRows, shard_ids: Iterable[str], column: str) -> None:
        for shard_id in shard_ids:
            rows.edit(SHARD_STATS, shard_id, _new_stats(shard_id))[column] += 1


def _set_live_status(pipeline: Row, *, degraded: bool = False) -> None:
    """Status of a pipeline that has not ended: degraded, streaming once a token came, else constructed."""
    if pipeline["status"] in TERMINAL_PIPELINE_STATUSES or pipeline["status"] == "fallback_local":
        return
    if degraded:
        pipeline["status"] = "degraded"
    else:
        pipeline["status"] = "streaming" if pipeline["first_token_at"] is not None else "constructed"


def _hops(pipeline: Row) -> list[str]:
    return json.loads(pipeline["hops"]) if pipeline["hops"] else []


def hops_after_failover(
    current_hops: list[str], failed_shard_id: str, replacement_hops: list[str]
) -> list[str]:
    """The pipeline's hops after a failover.

    Producers use `replacement_hops` in two ways: DESIGN.md §3's example lists only the shards taking over
    the failed shard's layers (hops [A 0-11, B 12-23], B fails, replacement [C 12-23] -> [A, C]), while an
    orchestrator that repicks the whole chain lists every new hop. It is read as the whole new chain when
    it repeats a surviving hop, when nothing survives, or when its layers (from the shard ids,
    `<model>:<lo>-<hi>@<node>`) reach from the chain's first layer to its last; otherwise it is spliced in
    at the failed shard's place.
    """
    surviving = [shard_id for shard_id in current_hops if shard_id != failed_shard_id]
    if failed_shard_id not in current_hops or not surviving or set(replacement_hops) & set(surviving):
        return list(replacement_hops)
    chain_span, replacement_span = _layer_span(current_hops), _layer_span(replacement_hops)
    if chain_span is not None and replacement_span is not None:
        if replacement_span[0] <= chain_span[0] and replacement_span[1] >= chain_span[1]:
            return list(replacement_hops)
    index = current_hops.index(failed_shard_id)
    return current_hops[:index] + list(replacement_hops) + current_hops[index + 1:]


_SHARD_ID_RE = re.compile(r"^(?P<model>.+):(?P<lo>\d+)-(?P<hi>\d+)@(?P<node>.+)$")


def _layer_span(shard_ids: list[str]) -> tuple[int, int] | None:
    """(lowest lo, highest hi) of the layer ranges named in the shard ids; None if one does not parse."""
    ranges = []
    for shard_id in shard_ids:
        match = _SHARD_ID_RE.match(shard_id)
        if match is None:
            return None
        ranges.append((int(match["lo"]), int(match["hi"])))
    if not ranges:
        return None
    return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

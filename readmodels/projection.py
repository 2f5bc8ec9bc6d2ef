"""Projects stored events into the read-model rows, exactly once: rows and stream position commit together.

`ReadModelProjection.apply_many(session, messages)` runs inside the caller's transaction: for each message
whose sequence is beyond its stream's stored position it runs the handler of its event class (one small
method per type, dispatched with functools.singledispatchmethod) and then moves that stream's position
forward; messages at or below the position (redeliveries, a replay over an up-to-date database) are no-ops.
The caller commits once, so a crash between two batches leaves rows and positions consistent.

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
from collections.abc import Iterable
from datetime import datetime
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
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

_shards = Shard.__table__
_shard_health = ShardHealth.__table__
_shard_stats = ShardStats.__table__
_positions = ProjectionPosition.__table__


class ConcurrentProjectionError(RuntimeError):
    """Another writer moved this projection's position during our transaction; the batch was not applied."""


def epoch_s(instant: datetime) -> int:
    """Floor to whole epoch seconds (the read models' INTEGER timestamp convention)."""
    return math.floor(instant.timestamp())


def load_positions(session: Session, projection: str = PROJECTION_NAME) -> dict[str, int]:
    """The last applied sequence per stream (streams never applied are absent)."""
    rows = session.execute(
        select(_positions.c.stream, _positions.c.last_seq).where(_positions.c.projection == projection)
    )
    return {stream: last_seq for stream, last_seq in rows}


class ReadModelProjection:
    """Event handlers for the read-model tables plus the position bookkeeping that makes them exactly once."""

    def __init__(self, name: str = PROJECTION_NAME) -> None:
        self.name = name

    # ---- applying messages -------------------------------------------------------------------------------

    def apply(self, session: Session, message: StoredEvent | SkippedMessage) -> bool:
        """Apply one message inside the session's transaction (the caller commits); False if already applied."""
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
                self.handle(event, session)
            positions[message.stream] = message.seq
            last_event_at[message.stream] = epoch_s(message.time)
            applied += 1
        for stream, last_seq in positions.items():
            if stream in last_event_at:
                self._save_position(session, stream, stored_positions.get(stream), last_seq, last_event_at[stream])
        return applied

    def _save_position(
        self, session: Session, stream: str, previous_seq: int | None, last_seq: int, last_event_at: int
    ) -> None:
        if previous_seq is None:
            # A concurrent first insert fails on the primary key, rolling our batch back.
            session.execute(
                insert(_positions).values(
                    projection=self.name, stream=stream, last_seq=last_seq, last_event_at=last_event_at
                )
            )
            return
        # Guarded by the value we read: if another projector advanced it meanwhile, nothing matches.
        result = session.execute(
            update(_positions)
            .where(
                _positions.c.projection == self.name,
                _positions.c.stream == stream,
                _positions.c.last_seq == previous_seq,
            )
            .values(last_seq=last_seq, last_event_at=last_event_at)
        )
        if result.rowcount != 1:
            raise ConcurrentProjectionError(
                f"projection {self.name!r} position of {stream} moved under us (expected {previous_seq})"
            )

    # ---- one handler per event type ---------------------------------------------------------------------

    @singledispatchmethod
    def handle(self, event: EventEnvelope, session: Session) -> None:
        """Events without a handler change no rows (their position still advances)."""
        log.debug("%s: no read-model handler for %s", self.name, type(event).__name__)

    @handle.register
    def _shard_advertised(self, event: ShardAdvertised, session: Session) -> None:
        advertised_at = epoch_s(event.occurred_at)
        values = dict(
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
            advertised_at=advertised_at,
            expires_at=math.floor(event.occurred_at.timestamp() + event.ttl_s),
            withdrawn_at=None,
            withdrawn_reason=None,
        )
        statement = sqlite_insert(_shards).values(shard_id=event.shard_id, **values)
        session.execute(statement.on_conflict_do_update(index_elements=[_shards.c.shard_id], set_=values))

    @handle.register
    def _shard_heartbeat(self, event: ShardHeartbeat, session: Session) -> None:
        health = dict(
            last_seen=epoch_s(event.occurred_at),
            queue_depth=event.queue_depth,
            active_streams=event.active_streams,
            p95_latency_ms=event.p95_latency_ms,
            tokens_served_total=event.tokens_served_total,
        )
        statement = sqlite_insert(_shard_health).values(shard_id=event.shard_id, **health)
        session.execute(statement.on_conflict_do_update(index_elements=[_shard_health.c.shard_id], set_=health))
        stats = sqlite_insert(_shard_stats).values(
            shard_id=event.shard_id,
            tokens_served=event.tokens_served_total,
            pipelines_joined=0,
            failovers_caused=0,
            corruption_detections=0,
        )
        session.execute(
            stats.on_conflict_do_update(
                index_elements=[_shard_stats.c.shard_id], set_={"tokens_served": event.tokens_served_total}
            )
        )

    @handle.register
    def _shard_withdrawn(self, event: ShardWithdrawn, session: Session) -> None:
        # A withdrawal whose advertisement has aged out of the log has no row to mark; nothing to route anyway.
        session.execute(
            update(_shards)
            .where(_shards.c.shard_id == event.shard_id)
            .values(status="withdrawn", withdrawn_at=epoch_s(event.occurred_at), withdrawn_reason=event.reason)
        )

    @handle.register
    def _pipeline_constructed(self, event: PipelineConstructed, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        pipeline.request_id = event.request_id
        pipeline.model_id = event.model_id
        pipeline.weights_sha256 = event.weights_sha256
        pipeline.orchestrator_node_id = event.node_id
        pipeline.construct_ms = event.construct_ms
        pipeline.constructed_at = epoch_s(event.occurred_at)
        newly_joined = [shard_id for shard_id in dict.fromkeys(event.hops) if shard_id not in _hops(pipeline)]
        pipeline.hops = json.dumps(list(event.hops))
        self._set_live_status(pipeline)
        self._count(session, newly_joined, "pipelines_joined")

    @handle.register
    def _pipeline_first_token(self, event: PipelineFirstToken, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        pipeline.ttft_ms = event.ttft_ms
        pipeline.first_token_at = epoch_s(event.occurred_at)
        self._set_live_status(pipeline)

    @handle.register
    def _pipeline_shard_status(self, event: PipelineShardStatus, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        pipeline.last_shard_status = event.status
        pipeline.last_shard_status_shard_id = event.shard_id
        self._set_live_status(pipeline, degraded=event.status == "degraded")

    @handle.register
    def _pipeline_failover(self, event: PipelineFailover, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        current_hops = _hops(pipeline)
        pipeline.failovers = (pipeline.failovers or 0) + 1
        session.add(
            Failover(
                pipeline_id=event.pipeline_id,
                n=pipeline.failovers,
                failed_shard_id=event.failed_shard_id,
                replacement_hops=json.dumps(list(event.replacement_hops)),
                reason=event.reason,
                resumed_at_token=event.resumed_at_token,
                occurred_at=epoch_s(event.occurred_at),
            )
        )
        pipeline.hops = json.dumps(hops_after_failover(current_hops, event.failed_shard_id, event.replacement_hops))
        self._set_live_status(pipeline)
        newly_joined = [s for s in dict.fromkeys(event.replacement_hops) if s not in current_hops]
        self._count(session, newly_joined, "pipelines_joined")
        self._count(session, [event.failed_shard_id], "failovers_caused")

    @handle.register
    def _pipeline_fallback_local(self, event: PipelineFallbackLocal, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        pipeline.fell_back_to_local = 1
        pipeline.fallback_reason = event.reason
        if pipeline.status not in TERMINAL_PIPELINE_STATUSES:
            pipeline.status = "fallback_local"

    @handle.register
    def _pipeline_completed(self, event: PipelineCompleted, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        pipeline.status = "completed"
        pipeline.prompt_tokens = event.prompt_tokens
        pipeline.completion_tokens = event.completion_tokens
        pipeline.duration_ms = event.duration_ms
        pipeline.tokens_per_second = event.tokens_per_second
        pipeline.finish_reason = event.finish_reason
        pipeline.finished_at = epoch_s(event.occurred_at)

    @handle.register
    def _pipeline_aborted(self, event: PipelineAborted, session: Session) -> None:
        pipeline = self._pipeline(session, event)
        pipeline.status = "aborted"
        pipeline.error_code = event.code
        pipeline.error_reason = event.reason
        pipeline.finished_at = epoch_s(event.occurred_at)

    @handle.register
    def _corruption_detected(self, event: IntegrityCorruptionDetected, session: Session) -> None:
        self._count(session, [event.shard_id], "corruption_detections")

    # ---- helpers -----------------------------------------------------------------------------------------

    @staticmethod
    def _pipeline(session: Session, event: Any) -> Pipeline:
        """The pipeline row of this event, created if an earlier event of it has aged out of the log."""
        pipeline = session.get(Pipeline, event.pipeline_id)
        if pipeline is None:
            pipeline = Pipeline(
                pipeline_id=event.pipeline_id,
                orchestrator_node_id=event.node_id,
                status="constructed",
                hops="[]",
                failovers=0,
                fell_back_to_local=0,
            )
            session.add(pipeline)
        pipeline.updated_at = epoch_s(event.occurred_at)
        return pipeline

    @staticmethod
    def _set_live_status(pipeline: Pipeline, *, degraded: bool = False) -> None:
        """Status of a pipeline that has not ended: degraded, streaming once a token came, else constructed."""
        if pipeline.status in TERMINAL_PIPELINE_STATUSES or pipeline.status == "fallback_local":
            return
        if degraded:
            pipeline.status = "degraded"
        else:
            pipeline.status = "streaming" if pipeline.first_token_at is not None else "constructed"

    @staticmethod
    def _count(session: Session, shard_ids: Iterable[str], column: str) -> None:
        for shard_id in shard_ids:
            statement = sqlite_insert(_shard_stats).values(
                shard_id=shard_id,
                tokens_served=0,
                pipelines_joined=0,
                failovers_caused=0,
                corruption_detections=0,
            )
            statement = statement.values({column: 1})
            session.execute(
                statement.on_conflict_do_update(
                    index_elements=[_shard_stats.c.shard_id],
                    set_={column: _shard_stats.c[column] + 1},
                )
            )


def _hops(pipeline: Pipeline) -> list[str]:
    return json.loads(pipeline.hops) if pipeline.hops else []


def hops_after_failover(current_hops: list[str], failed_shard_id: str, replacement_hops: list[str]) -> list[str]:
    """The pipeline's hops after a failover.

    `replacement_hops` is read as the shards taking over the failed shard's layers, spliced in at its place
    (DESIGN.md §3's example: hops [A, B], B fails, replacement [C] -> [A, C]). If it instead repeats any
    surviving hop it is a whole new hop list (a full repick) and replaces the hops as they are.
    """
    surviving = [shard_id for shard_id in current_hops if shard_id != failed_shard_id]
    if failed_shard_id not in current_hops or set(replacement_hops) & set(surviving):
        return list(replacement_hops)
    index = current_hops.index(failed_shard_id)
    return current_hops[:index] + list(replacement_hops) + current_hops[index + 1:]

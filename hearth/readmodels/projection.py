"""Projects stored events into the read-model rows, exactly once: rows and stream position commit together.

`ReadModelProjection.apply_many(session, messages)` runs inside the caller's transaction: for each message
whose sequence is beyond its stream's stored position it runs the handler of its event class (one small
method per type, dispatched with functools.singledispatchmethod) and then moves that stream's position
forward; messages at or below the position (redeliveries, a replay over an up-to-date database) are no-ops, and a
copy of an event applied before, stored again past the broker's duplicate window, is rejected (applied_events), and a
heartbeat's copy changes and counts nothing.
The caller commits once, so a crash between two batches leaves rows and positions consistent.

Handlers do not talk SQL: they edit plain dict rows held by a readmodels.batch_rows.BatchRows unit of
work, flushed before the positions (readmodels.positions) are moved. On a community mesh an event is applied only
when readmodels.admission lets it (signed by a member that may emit it, not after its signer's removal there).

Determinism: every stored value comes from the event (instants from `occurred_at`, never the wall clock),
each table column is written from one stream only (but event_counts' minute of
member.removed, published in both, which sums them in any order), and rows are keyed on the payload (shard_id,
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
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from hearth.events.models import (
    UNVERIFIED_REPORT,
    EventEnvelope,
    IntegrityCorruptionDetected,
    MemberRemoved,
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
from hearth.events.signing import EventVerifier, RejectionReason
from hearth.readmodels.admission import Rejection, record_member_removal, rejection
from hearth.readmodels.applied_events import (
    preload_applied,
    record_applied,
    repeat_rejection,
    repeats_what_is_known,
)
from hearth.events.streams import seconds_per_day
from hearth.protocol.subjects import node_of_shard
from hearth.readmodels.batch_rows import (
    EVENT_COUNTS,
    FAILOVERS,
    HOST_TOKENS_DAILY,
    PIPELINES,
    SHARD_HEALTH,
    SHARD_STATS,
    SHARDS,
    TABLE_SQL,
    BatchRows,
    Row,
    saturating_add,
)
from hearth.readmodels.kept_prefixes import prune_expired_kept_prefixes, record_kept_prefix
from hearth.readmodels.pipeline_hops import hops_after_failover
from hearth.readmodels.pipeline_minutes import refresh_minutes
from hearth.readmodels.positions import PROJECTION_NAME, load_positions, save_position
from hearth.readmodels.rejections import record_rejection
from hearth.readmodels.reputation import ReputationEvent, apply_reputation_event
from hearth.readmodels.retention import RetentionPolicy, history_kept_s

if TYPE_CHECKING:
    from hearth.events.consume import SkippedMessage, StoredEvent

log = logging.getLogger(__name__)

TERMINAL_PIPELINE_STATUSES = frozenset({"completed", "aborted"})


def epoch_s(instant: datetime) -> int:
    """Floor to whole epoch seconds (the read models' INTEGER timestamp convention)."""
    return math.floor(instant.timestamp())


def _older_than_what_is_known(row: Row | None, event: EventEnvelope, *time_columns: str) -> bool:
    """A shard's state follows its newest event: one older (by a whole second) than a time the row already
    holds is history, not news. A correctly signed old event re-published after the broker's de-duplication
    window (a replay) therefore changes nothing: an old withdrawal cannot hide a shard advertised since."""
    if row is None:
        return False
    occurred_s = epoch_s(event.occurred_at)
    return any(row.get(column) is not None and row[column] > occurred_s for column in time_columns)


def _new_stats(shard_id: str) -> Callable[[], Row]:
    return lambda: dict(
        shard_id=shard_id, tokens_served=0, pipelines_joined=0, failovers_caused=0, corruption_detections=0,
        last_counted_at=None, first_counted_at=None,
    )


class ReadModelProjection:
    """Event handlers for the read-model tables plus the position bookkeeping that makes them exactly once."""

    def __init__(self, name: str = PROJECTION_NAME, *, verifier: EventVerifier | None = None,
                 retention: RetentionPolicy | None = None) -> None:
        self.name = name
        # None (an open mesh, no roster): every decodable event is applied, as before events were signed.
        self.verifier = verifier
        # Rejected events kept as rows per minute, stream and reason (None, no policy: every one).
        self.rejected_samples_per_minute = None if retention is None else retention.rejected_samples_per_minute
        self.retention = retention  # how long applied event ids are kept, so how old an event may be (applied_events)

    # ---- applying messages -------------------------------------------------------------------------------

    def apply(self, session: Session, message: StoredEvent | SkippedMessage) -> bool:
        """Apply one message in the session's transaction (the caller commits); False if applied before."""
        return self.apply_many(session, (message,)) == 1

    def apply_many(self, session: Session, messages: Iterable[StoredEvent | SkippedMessage], *,
                   rejections: list[Rejection] | None = None, reject_as: RejectionReason | None = None) -> int:
        """Apply messages (any mix of streams, each stream in sequence order) inside the session's current
        transaction, then write each touched stream's new position in that same transaction.

        With a verifier, an event that fails it is not applied: it becomes a rejected_events row (and is
        appended to `rejections`, for the caller to count once it has committed) and its position advances; with
        `reject_as`, so is every event, for that reason (readmodels.unapplicable). So is a copy of an event applied
        before, or one older than applied ids are kept (readmodels.applied_events: `duplicate`, `too_old`).
        Returns how many messages moved a position (skipped, undecodable and rejected ones included). The
        caller commits; if it rolls back instead, neither rows nor positions change.
        """
        stored_positions = load_positions(session, self.name)
        positions = dict(stored_positions)
        last_event_at: dict[str, int] = {}
        applied = 0
        rows = BatchRows(session)
        messages = tuple(messages)
        try:
            preload_applied(messages, rows)
            for message in messages:
                if message.seq <= positions.get(message.stream, 0):
                    continue
                event = getattr(message, "event", None)
                if event is None:
                    log.warning(
                        "%s: skipping undecodable message %s #%d on %s: %s",
                        self.name, message.stream, message.seq, message.subject, message.error,
                    )
                elif (reason := reject_as or rejection(self.verifier, message, rows) or repeat_rejection(
                        message, rows, history_kept_s(self.retention, message.stream))) is not None:
                    record_rejection(message, reason, rows, projection=self.name,
                                     samples_per_minute=self.rejected_samples_per_minute)
                    if rejections is not None:
                        rejections.append(Rejection(message.stream, message.seq, event.type, reason))
                elif not repeats_what_is_known(event, rows):  # a heartbeat's copy: no figure, no count
                    self.handle(event, rows)
                    _count_event(event, rows)
                    record_applied(message, rows)
                positions[message.stream] = message.seq
                last_event_at[message.stream] = epoch_s(message.time)
                applied += 1
            refresh_minutes(rows.cursor, rows.flush())
            prune_expired_kept_prefixes(rows)
        finally:
            rows.close()
        for stream, at in last_event_at.items():
            save_position(session, self.name, stream, stored_positions.get(stream), positions[stream], at)
        return applied

    # ---- one handler per event type ---------------------------------------------------------------------

    @singledispatchmethod
    def handle(self, event: EventEnvelope, rows: BatchRows) -> None:
        """Events without a handler change no rows (their position still advances)."""
        log.debug("%s: no read-model handler for %s", self.name, type(event).__name__)

    @handle.register
    def _shard_advertised(self, event: ShardAdvertised, rows: BatchRows) -> None:
        previous = rows.get(SHARDS, event.shard_id)
        if _older_than_what_is_known(previous, event, "advertised_at", "withdrawn_at"):
            return
        if previous is not None and previous["status"] == "withdrawn":
            # Advertised again after leaving: a new process, whose step time is unknown until it reports one.
            health = rows.edit(SHARD_HEALTH, event.shard_id)
            if health is not None and health["decode_step_ms"] is not None:
                health["decode_step_ms"] = None
        rows.put(SHARDS, event.shard_id, dict(
            shard_id=event.shard_id,
            model_id=event.model_id,
            weights_sha256=event.weights_sha256,
            node_id=event.node_id,
            layer_lo=event.layer_lo,
            layer_hi=event.layer_hi,
            total_layers=event.total_layers,
            dtype=event.dtype,
            quantization=event.quantization,
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
        # One older than the row's, or a copy of the row's, never comes here (applied_events.repeats_what_is_known).
        rows.put(SHARD_HEALTH, event.shard_id, dict(
            shard_id=event.shard_id,
            heartbeat_id=event.event_id,
            last_seen=epoch_s(event.occurred_at),
            queue_depth=event.queue_depth,
            active_streams=event.active_streams,
            p95_latency_ms=event.p95_latency_ms,
            tokens_served_total=event.tokens_served_total,
            decode_step_ms=event.decode_step_ms,
        ))
        rows.edit(SHARD_STATS, event.shard_id, _new_stats(event.shard_id))["tokens_served"] = (
            event.tokens_served_total
        )

    @handle.register
    def _shard_withdrawn(self, event: ShardWithdrawn, rows: BatchRows) -> None:
        # A withdrawal whose advertisement aged out of the log has no row to mark; nothing to route anyway.
        if _older_than_what_is_known(rows.get(SHARDS, event.shard_id), event, "advertised_at"):
            return
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
            cached_prompt_tokens=event.cached_prompt_tokens,
            constructed_at=epoch_s(event.occurred_at),
            hops=json.dumps(list(event.hops)),
        )
        _set_live_status(pipeline)
        self._count(rows, newly_joined, "pipelines_joined", event)

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
        self._count(rows, newly_joined, "pipelines_joined", event)
        if event.reason != UNVERIFIED_REPORT:  # a hop's unverified word about another blames nobody
            self._count(rows, [event.failed_shard_id], "failovers_caused", event)

    @handle.register
    def _pipeline_fallback_local(self, event: PipelineFallbackLocal, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        pipeline.update(fell_back_to_local=1, fallback_reason=event.reason)
        if pipeline["status"] not in TERMINAL_PIPELINE_STATUSES:
            pipeline["status"] = "fallback_local"

    @handle.register
    def _pipeline_completed(self, event: PipelineCompleted, rows: BatchRows) -> None:
        pipeline = self._pipeline(rows, event)
        day = epoch_s(event.occurred_at) // seconds_per_day * seconds_per_day
        # Once per host, however many hops it held; the host from the shard id, not the shards row, so the pipelines
        # stream alone decides it (a rebuild gives the same rows whatever the two streams' interleaving).
        for node_id in dict.fromkeys(node_of_shard(shard_id) or shard_id for shard_id in _hops(pipeline)):
            tokens = rows.edit(HOST_TOKENS_DAILY, (day, node_id),
                               lambda node_id=node_id: dict(day=day, node_id=node_id, tokens=0))
            tokens["tokens"] = saturating_add(tokens["tokens"], event.prompt_tokens + event.completion_tokens)
        pipeline.update(
            status="completed",
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            duration_ms=event.duration_ms,
            tokens_per_second=event.tokens_per_second,
            finish_reason=event.finish_reason,
            finished_at=epoch_s(event.occurred_at),
        )
        record_kept_prefix(event, rows)

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
        self._count(rows, [event.shard_id], "corruption_detections", event)

    @handle.register
    def _verification_outcome(self, event: ReputationEvent, rows: BatchRows) -> None:
        apply_reputation_event(event, rows)  # one handler per type there: shard_reputation, integrity_evidence

    @handle.register
    def _member_removed(self, event: MemberRemoved, rows: BatchRows) -> None:
        record_member_removal(event, rows)  # the cut later events of its key on this stream are held to

    # ---- helpers -----------------------------------------------------------------------------------------

    @staticmethod
    def _pipeline(rows: BatchRows, event: Any) -> Row:
        """The pipeline row of this event, created if an earlier event of it has aged out of the log."""

        def new_pipeline() -> Row:
            row: Row = {column: None for column in TABLE_SQL[PIPELINES.name].columns}
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
    def _count(rows: BatchRows, shard_ids: Iterable[str], column: str, event: EventEnvelope) -> None:
        counted_at = epoch_s(event.occurred_at)
        for shard_id in shard_ids:
            stats = rows.edit(SHARD_STATS, shard_id, _new_stats(shard_id))
            stats[column] += 1
            stats["last_counted_at"] = max(stats["last_counted_at"] or counted_at, counted_at)
            # When its sums began, so a diff against a log that dropped older calls can tell whether they are whole.
            first = stats["first_counted_at"]
            stats["first_counted_at"] = counted_at if first is None else min(first, counted_at)


def _count_event(event: EventEnvelope, rows: BatchRows) -> None:
    """One more applied event of its type in the minute it occurred (event_counts)."""
    key = (epoch_s(event.occurred_at) // 60 * 60, event.type)
    rows.edit(EVENT_COUNTS, key, lambda: dict(minute=key[0], type=key[1], events=0))["events"] += 1


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

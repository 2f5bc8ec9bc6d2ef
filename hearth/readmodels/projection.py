"""Projects stored events into the read-model rows, exactly once: rows and stream position commit together.

`ReadModelProjection.apply_many(session, messages)` runs inside the caller's transaction: for each message
whose sequence is beyond its stream's stored position it runs the handler of its event class (dispatched with
functools.singledispatchmethod to one small function per type: readmodels.shard_rows, readmodels.pipeline_rows,
readmodels.reputation) and then moves that stream's position forward; messages at or below the position
(redeliveries, a replay over an up-to-date database) are no-ops, and a copy of an event applied before, stored again
past the broker's duplicate window, is rejected (applied_events), and a heartbeat's copy changes and counts nothing.
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

import logging
from collections.abc import Iterable
from functools import singledispatchmethod
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from hearth.events.clock_skew import ClockSkewReports
from hearth.events.models import EventEnvelope, MemberAdded, MemberRemoved, ShardHeartbeat
from hearth.events.signing import DEFAULT_MAX_CLOCK_SKEW_S, EventVerifier, RejectionReason
from hearth.readmodels.admission import Rejection, newer_rejection, record_member_addition, record_member_removal, \
    rejection
from hearth.readmodels.applied_events import (
    preload_applied,
    record_applied,
    repeat_rejection,
    repeats_what_is_known,
)
from hearth.readmodels.batch_rows import EVENT_COUNTS, BatchRows, epoch_s
from hearth.readmodels.kept_prefixes import prune_expired_kept_prefixes
from hearth.readmodels.pipeline_minutes import refresh_minutes
from hearth.readmodels.pipeline_rows import PipelineEvent, apply_pipeline_event
from hearth.readmodels.positions import PROJECTION_NAME, load_positions, save_position
from hearth.readmodels.rejections import NEWER_HEARTH, record_newer_hearths, record_rejection
from hearth.readmodels.reputation import ReputationEvent, apply_reputation_event
from hearth.readmodels.retention import RetentionPolicy, history_kept_s
from hearth.readmodels.shard_rows import (ShardEvent, apply_shard_event, clock_skew_s, heard_at_s, note_future_dated,
                                         note_heard)

if TYPE_CHECKING:
    from hearth.events.consume import SkippedMessage, StoredEvent

log = logging.getLogger(__name__)


class ReadModelProjection:
    """Event handlers for the read-model tables plus the position bookkeeping that makes them exactly once."""

    def __init__(self, name: str = PROJECTION_NAME, *, verifier: EventVerifier | None = None,
                 retention: RetentionPolicy | None = None, max_clock_skew_s: float | None = None) -> None:
        self.name = name
        # None (an open mesh, no roster): every decodable event is applied, as before events were signed.
        self.verifier = verifier
        # How far a host's clock may be off the broker's and its heartbeats still count from when they were stored
        # (shard_rows.heard_at_s): the verifier's limit unless given, else the default one, so that a projection with
        # a verifier and a rebuild without one (an open mesh's, or one given no roster) keep the same rows.
        verifiers_limit = getattr(verifier, "max_clock_skew", None)
        self.max_clock_skew_s = max_clock_skew_s if max_clock_skew_s is not None else (
            DEFAULT_MAX_CLOCK_SKEW_S if verifiers_limit is None else verifiers_limit.total_seconds())
        self.skew_reports = ClockSkewReports()  # a node's clock far off the broker's, told once a while
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
        An event only a newer hearth reads is recorded as rejected too (`newer_hearth`), while a message that is no
        event at all only moves the position.
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
                if event is None:  # logged as it was read (events.consume)
                    reason = newer_rejection(self.verifier, message, rows) or NEWER_HEARTH
                    if record_newer_hearths(message, rows, samples_per_minute=self.rejected_samples_per_minute,
                                            reason=reason, projection=self.name) and rejections is not None:
                        rejections.append(Rejection(message.stream, message.seq, message.newer.label, reason))
                elif (reason := reject_as or rejection(self.verifier, message, rows) or repeat_rejection(
                        message, rows, history_kept_s(self.retention, message.stream))) is not None:
                    record_rejection(message, reason, rows, projection=self.name,
                                     samples_per_minute=self.rejected_samples_per_minute)
                    if reason == "future_dated":
                        self._skewed(message, "its events are rejected (future_dated), so its shards are not routed")
                        note_future_dated(event, rows, clock_skew_s(event, message.time))
                    if rejections is not None:
                        rejections.append(Rejection(message.stream, message.seq, event.type, reason))
                elif not repeats_what_is_known(event, rows, heard_s := heard_at_s(event, message.time,
                                                                                  self.max_clock_skew_s)):
                    self.handle(event, rows)  # a heartbeat's copy (repeats_what_is_known): no figure, no count
                    note_heard(event, rows, heard_s, clock_skew_s(event, message.time))
                    if self._dated_far_behind(event, message, heard_s):
                        self._skewed(message, "its heartbeats read as old, so its shards are not routed")
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

    def _dated_far_behind(self, event: EventEnvelope, message: StoredEvent, heard_s: int) -> bool:
        """A heartbeat (published at once, never from an outbox) dated beyond the limit before it was stored."""
        return (isinstance(event, ShardHeartbeat)
                and heard_s < message.time.timestamp() - self.max_clock_skew_s)

    def _skewed(self, message: StoredEvent, consequence: str) -> None:
        """Say (once a while per node, events.clock_skew) that the node of `message` dates its events far off the
        broker's clock."""
        self.skew_reports.skewed("event", message.event.node_id,
                                 message.event.occurred_at.timestamp() - message.time.timestamp(),
                                 clock="the broker's clock", allowed_s=self.max_clock_skew_s,
                                 consequence=consequence)

    # ---- one handler per event type ---------------------------------------------------------------------

    @singledispatchmethod
    def handle(self, event: EventEnvelope, rows: BatchRows) -> None:
        """Events without a handler change no rows (their position still advances)."""
        log.debug("%s: no read-model handler for %s", self.name, type(event).__name__)

    @handle.register
    def _shard_event(self, event: ShardEvent, rows: BatchRows) -> None:
        apply_shard_event(event, rows)  # one handler per type there: shards, shard_health, shard_stats

    @handle.register
    def _pipeline_event(self, event: PipelineEvent, rows: BatchRows) -> None:
        apply_pipeline_event(event, rows)  # one handler per type there: pipelines, failovers, host_tokens_daily

    @handle.register
    def _verification_outcome(self, event: ReputationEvent, rows: BatchRows) -> None:
        apply_reputation_event(event, rows)  # one handler per type there: shard_reputation, integrity_evidence

    @handle.register
    def _member_removed(self, event: MemberRemoved, rows: BatchRows) -> None:
        record_member_removal(event, rows)  # the cut later events of its key on this stream are held to

    @handle.register
    def _member_added(self, event: MemberAdded, rows: BatchRows) -> None:
        record_member_addition(event, rows)  # its key signs as the member on this stream from here on


def _count_event(event: EventEnvelope, rows: BatchRows) -> None:
    """One more applied event of its type in the minute it occurred (event_counts)."""
    key = (epoch_s(event.occurred_at) // 60 * 60, event.type)
    rows.edit(EVENT_COUNTS, key, lambda: dict(minute=key[0], type=key[1], events=0))["events"] += 1

"""Projects the shards' own events into their rows: an advertisement, a heartbeat or a withdrawal into shards and
shard_health, and what a shard was counted for (pipelines joined, failovers caused, corruption detected) into
shard_stats.

One handler per event type, dispatched by `apply_shard_event` (readmodels.projection calls it, and `note_heard` for a
heartbeat: when the broker stored it, `heard_at_s`, while the host's clock is near enough, and how far its date was
off, as `note_future_dated` does for one rejected as dated too far ahead); `count_for_shards`
is how a pipeline's events count against the shards in it too. A shard's state follows its newest event, so an old
one re-published past the broker's de-duplication window changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import singledispatch

from hearth.events.models import (
    EventEnvelope,
    IntegrityCorruptionDetected,
    ShardAdvertised,
    ShardHeartbeat,
    ShardWithdrawn,
)
from hearth.readmodels.batch_rows import SHARD_HEALTH, SHARD_STATS, SHARDS, BatchRows, Row, epoch_s

ShardEvent = ShardAdvertised | ShardHeartbeat | ShardWithdrawn | IntegrityCorruptionDetected


def _older_than_what_is_known(row: Row | None, event: EventEnvelope, *time_columns: str) -> bool:
    """A shard's state follows its newest event: one older (by a whole second) than a time the row already
    holds is history, not news. A correctly signed old event re-published after the broker's de-duplication
    window (a replay) therefore changes nothing: an old withdrawal cannot hide a shard advertised since."""
    if row is None:
        return False
    occurred_s = epoch_s(event.occurred_at)
    return any(row.get(column) is not None and row[column] > occurred_s for column in time_columns)


def heard_at_s(event: EventEnvelope, stored_at: datetime, max_clock_skew_s: float) -> int:
    """When a heartbeat counts its shard as heard (shard_health.last_seen): when the broker stored it, while its
    date is within `max_clock_skew_s` of that ([events], the verifier's, or its default without one). A host
    whose clock is off by less than the limit is then judged as one whose clock is right (a host 29 s behind would
    otherwise look dead between beats, one ahead be heard in the future), and one farther off stays judged by its
    own date, as a replayed old heartbeat is (nothing it says is news)."""
    occurred_s, stored_s = event.occurred_at.timestamp(), stored_at.timestamp()
    if abs(occurred_s - stored_s) <= max_clock_skew_s:
        return math.floor(stored_s)
    return math.floor(occurred_s)


def clock_skew_s(event: EventEnvelope, stored_at: datetime) -> int:
    """How far an event's date is off when the broker stored it, in whole s (positive: dated ahead)."""
    return round(event.occurred_at.timestamp() - stored_at.timestamp())


def note_heard(event: EventEnvelope, rows: BatchRows, heard_s: int, skew_s: int) -> None:
    """Set a heartbeat's shard_health row (its handler just wrote it) to when it was heard (heard_at_s) and how far
    its date was off (clock_skew_s)."""
    row = rows.edit(SHARD_HEALTH, event.shard_id) if isinstance(event, ShardHeartbeat) else None
    if row is not None:
        row.update(last_seen=heard_s, clock_skew_s=skew_s)


def note_future_dated(event: EventEnvelope, rows: BatchRows, skew_s: int) -> None:
    """Keep on its shard's shard_health row how far ahead a heartbeat rejected `future_dated` was dated (its signer
    and node were checked first), so routing says why the shard, no longer heard, is left out; nothing else of the
    row changes, and the next heartbeat applied sets it again."""
    row = rows.edit(SHARD_HEALTH, event.shard_id) if isinstance(event, ShardHeartbeat) else None
    if row is not None:
        row["clock_skew_s"] = skew_s


def _new_stats(shard_id: str) -> Callable[[], Row]:
    return lambda: dict(
        shard_id=shard_id, tokens_served=0, pipelines_joined=0, failovers_caused=0, corruption_detections=0,
        last_counted_at=None, first_counted_at=None,
    )


def count_for_shards(rows: BatchRows, shard_ids: Iterable[str], column: str, event: EventEnvelope) -> None:
    """One more of `column` (a shard_stats counter) for each shard, at the event's instant."""
    counted_at = epoch_s(event.occurred_at)
    for shard_id in shard_ids:
        stats = rows.edit(SHARD_STATS, shard_id, _new_stats(shard_id))
        stats[column] += 1
        stats["last_counted_at"] = max(stats["last_counted_at"] or counted_at, counted_at)
        # When its sums began, so a diff against a log that dropped older calls can tell whether they are whole.
        first = stats["first_counted_at"]
        stats["first_counted_at"] = counted_at if first is None else min(first, counted_at)


@singledispatch
def apply_shard_event(event: EventEnvelope, rows: BatchRows) -> None:
    """Edit the rows a shard event changes (one of ShardEvent; the projection dispatches no other here)."""
    raise TypeError(f"no shard-row handler for {type(event).__name__}")


@apply_shard_event.register
def _shard_advertised(event: ShardAdvertised, rows: BatchRows) -> None:
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
        protocol=event.protocol,
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


@apply_shard_event.register
def _shard_heartbeat(event: ShardHeartbeat, rows: BatchRows) -> None:
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
        clock_skew_s=None,  # note_heard sets it, from when the broker stored it
    ))
    rows.edit(SHARD_STATS, event.shard_id, _new_stats(event.shard_id))["tokens_served"] = (
        event.tokens_served_total
    )


@apply_shard_event.register
def _shard_withdrawn(event: ShardWithdrawn, rows: BatchRows) -> None:
    # A withdrawal whose advertisement aged out of the log has no row to mark; nothing to route anyway.
    if _older_than_what_is_known(rows.get(SHARDS, event.shard_id), event, "advertised_at"):
        return
    shard = rows.edit(SHARDS, event.shard_id)
    if shard is not None:
        shard.update(
            status="withdrawn", withdrawn_at=epoch_s(event.occurred_at), withdrawn_reason=event.reason
        )


@apply_shard_event.register
def _corruption_detected(event: IntegrityCorruptionDetected, rows: BatchRows) -> None:
    count_for_shards(rows, [event.shard_id], "corruption_detections", event)

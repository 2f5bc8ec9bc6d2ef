"""Which stored events a projection has applied already, by event id: the check that makes a read model count each
event once however many times the stream stored it, and the record of each applied event it checks against.

Why: JetStream drops a re-publish with the same `Nats-Msg-Id` (the event id) only within the stream's duplicate window
(hearth/events/streams.py); a copy stored later (a process retrying late, a member re-publishing a signed event it
captured) is a second stream message. The id of every applied event is kept in applied_events, written in the batch's
transaction with the handler's rows and the position, so a copy is rejected `duplicate` in a live projector, a rebuild
and after a restart alike. The ids are kept as long as the stream's history (readmodels.retention); an event that
claims to be older than that, measured from when the stream stored it, is rejected `too_old`, so no copy can outlive
the id that would have caught it.

Heartbeats keep no id: each one states a shard's latest figures, and their ids (one every few seconds per shard, for
the whole history) would be most of the table. Their shard's shard_health row tells a repeat instead: one older than
the heartbeat the row states, or a copy of that one (its `heartbeat_id`), changes no figure and is not counted in
event_counts either (`repeats_what_is_known`). Not told apart: a copy of an earlier heartbeat of the same whole second
as the row's (only with `heartbeat_interval_s` under 1 s), which is taken as news.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hearth.events.models import EventEnvelope, ShardHeartbeat
from hearth.events.signing import RejectionReason
from hearth.readmodels.batch_rows import APPLIED_EVENTS, SHARD_HEALTH, BatchRows

if TYPE_CHECKING:
    from hearth.events.consume import SkippedMessage, StoredEvent

DUPLICATE: RejectionReason = "duplicate"
TOO_OLD: RejectionReason = "too_old"
# Event types whose handlers state a value rather than add to one: a copy changes nothing, and no id is kept.
IDEMPOTENT_TYPES = frozenset({ShardHeartbeat.model_fields["type"].default})


def older_than_kept(message: StoredEvent, kept_s: float | None) -> bool:
    """Whether the event claims to have occurred more than `kept_s` before its stream stored it (None: kept for ever):
    its id, had it been applied, would have been pruned by then."""
    return kept_s is not None and message.event.occurred_at.timestamp() < message.time.timestamp() - kept_s


def preload_applied(messages: Iterable[StoredEvent | SkippedMessage], rows: BatchRows) -> None:
    """Look the batch's events up in applied_events at once (a query per few hundred, not one per event)."""
    rows.preload(APPLIED_EVENTS, (_key(message) for message in messages
                                  if getattr(message, "event", None) is not None and keeps_id(message)))


def repeat_rejection(message: StoredEvent, rows: BatchRows, kept_s: float | None) -> RejectionReason | None:
    """`too_old` or `duplicate` when `message` must not be applied for being (perhaps) a copy; None: apply it."""
    if older_than_kept(message, kept_s):
        return TOO_OLD
    if keeps_id(message) and rows.get(APPLIED_EVENTS, _key(message)) is not None:
        return DUPLICATE
    return None


def record_applied(message: StoredEvent, rows: BatchRows) -> None:
    """Keep the id of the event `message` holds, applied in this batch (only an applied one: a forged copy rejected
    first must not block the real event)."""
    if not keeps_id(message):
        return
    stream, occurred_at, event_id = key = _key(message)
    rows.put(APPLIED_EVENTS, key, dict(stream=stream, occurred_at=occurred_at, event_id=event_id))


def repeats_what_is_known(event: EventEnvelope, rows: BatchRows, heard_s: int | None = None) -> bool:
    """Whether `event` is a heartbeat its shard's row has news of already: heard earlier than the heartbeat the row
    states (by a whole second; `heard_s`, shard_rows.heard_at_s, else its own date), or a copy of that one; it is
    then neither applied nor counted (its position still advances)."""
    if event.type not in IDEMPOTENT_TYPES:
        return False
    health = rows.get(SHARD_HEALTH, event.shard_id)  # type: ignore[attr-defined]
    if health is None:
        return False
    heard_s = math.floor(event.occurred_at.timestamp()) if heard_s is None else heard_s
    return health["last_seen"] > heard_s or health["heartbeat_id"] == event.event_id


def _key(message: StoredEvent) -> tuple[str, int, str]:
    """Its row's key: a copy of a signed event claims the same time as the original (the signature covers it), and a
    sender that would change the time could as well mint a new id."""
    return message.stream, math.floor(message.event.occurred_at.timestamp()), message.event.event_id


def keeps_id(message: StoredEvent) -> bool:
    """Whether the id of the event `message` holds is kept, and a copy of it rejected (not for IDEMPOTENT_TYPES)."""
    return message.event.type not in IDEMPOTENT_TYPES

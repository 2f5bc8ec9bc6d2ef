"""Records an event a projection did not apply: counted in rejected_event_counts per minute, stream and reason, and
kept as a rejected_events row while that count is within the sample limit, so a flood of junk grows neither table
past a fixed number of rows per minute (docs/design.md §4, "Retention")."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from hearth.events.envelope import EventEnvelope
from hearth.events.signing import RejectionReason
from hearth.readmodels.batch_rows import REJECTED_EVENT_COUNTS, REJECTED_EVENTS, BatchRows, saturating_add

if TYPE_CHECKING:
    from hearth.events.consume import SkippedMessage, StoredEvent

log = logging.getLogger(__name__)

# An event only a newer hearth reads (hearth/events/newer_hearth.py): kept, so a newer projector finds what it missed.
NEWER_HEARTH: RejectionReason = "newer_hearth"

# What an operator most often has to do about a reason, where the reason alone leaves it a guess.
LIKELY_CAUSE: dict[RejectionReason, str] = {
    "unknown_signer": " (a key this process's roster does not name: a member added, or a key rotated, since this "
                      "machine got its roster.json? hand it the steward's current one; no restart needed)",
}


def record_rejection(message: StoredEvent, reason: RejectionReason, rows: BatchRows, *, projection: str,
                     samples_per_minute: int | None) -> None:
    """Count the rejected message and keep it as a sample unless its minute already holds `samples_per_minute` of
    its stream and reason (None: keep every one). By the time the stream stored it, never the event's own claim."""
    event = message.event
    if _record(message, event, event.type, reason, rows, samples_per_minute):
        # Logged only as it is kept: a flood logs no more lines than it leaves rows.
        _log_rejected(projection, message, event, event.type, reason)


def record_newer_hearths(message: SkippedMessage, rows: BatchRows, *, samples_per_minute: int | None,
                         reason: RejectionReason = NEWER_HEARTH, projection: str = "") -> bool:
    """Count and keep, as rejected for `reason` (`newer_hearth`, or why no member signed it), a skipped message that
    is an event only a newer hearth reads, named by its type (and version); False when it is no event at all (not
    even its envelope validates). Logged only for another reason: its reader told of its type already
    (events.newer_hearth)."""
    newer = message.newer
    if newer is None or newer.envelope is None:
        return False
    event = newer.envelope
    if _record(message, event, newer.label, reason, rows, samples_per_minute) and reason != NEWER_HEARTH:
        _log_rejected(projection, message, event, newer.label, reason)
    return True


def _log_rejected(projection: str, message: StoredEvent | SkippedMessage, event: EventEnvelope, event_type: str,
                  reason: RejectionReason) -> None:
    log.warning("%s: rejected %s #%d %s %s from node %s (signer %s): %s%s", projection, message.stream, message.seq,
                event_type, event.event_id, event.node_id, event.signer or "none", reason, LIKELY_CAUSE.get(reason, ""))


def _record(message: StoredEvent | SkippedMessage, event: EventEnvelope, event_type: str, reason: RejectionReason,
            rows: BatchRows, samples_per_minute: int | None) -> bool:
    """Count the message and keep it as a row while its minute's count is within the samples; True: kept."""
    rejected_at = math.floor(message.time.timestamp())
    key = (rejected_at // 60 * 60, message.stream, reason)
    counted = rows.edit(REJECTED_EVENT_COUNTS, key, lambda: dict(minute=key[0], stream=key[1], reason=key[2],
                                                                 events=0))
    counted["events"] = saturating_add(counted["events"], 1)
    if samples_per_minute is not None and counted["events"] > samples_per_minute:
        return False
    rows.put(REJECTED_EVENTS, (message.stream, message.seq), dict(
        stream=message.stream,
        stream_seq=message.seq,
        event_id=event.event_id,
        type=event_type,
        node_id=event.node_id,
        signer=event.signer,
        reason=reason,
        occurred_at=math.floor(event.occurred_at.timestamp()),
        rejected_at=rejected_at,
    ))
    return True

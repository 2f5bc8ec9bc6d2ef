"""Which stored events a projection applies on a community mesh: the verifier's verdict on each
(hearth/events/signing.py), told of the member removals and the steward keys the stream's own log has shown before
it, and the record of each removal (`member.removed`, `member.key_rotated`) as the stream shows it (an event turned
away is recorded by rejections.py).

A removal is a position in each stream, not a time: the first verified `member.removed` of a key on a stream is kept
in member_removals in the batch's transaction, and every later event of that key on that stream is rejected
(`removed_signer`), whatever the roster file says yet. A rebuild reads the same events in the same order, so it
rejects exactly what the live projection did.

A rotation of the steward's own key is kept the same way (steward_keys): the key it names is the steward's on that
stream from there on (hearth/events/steward_keys.py), before the roster file names it and after a restart. So is a
rotation of another member's key (member_keys): the key it names is that member's on that stream from there on
(hearth/events/member_keys.py), unless the roster file gives the member yet another key. So is an addition
(member_additions): the member it adds signs on that stream from there on (hearth/events/member_additions.py), unless
the roster file knows its name or key otherwise.

A pipeline is its builder's: once the pipelines stream has shown a pipeline's row, a `pipeline.*` event of it from
another orchestrator is rejected (`node_mismatch`). Every orchestrator reads the pipelines stream, so it knows every
call's id, and its own signed events would otherwise rewrite another's call (its status, hops and owner) and credit
that call's hosts with tokens again. The row comes from the same stream's earlier events, so a rebuild agrees.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from hearth.events.member_additions import AdditionLookup, LoggedAddition, logged_addition
from hearth.events.member_keys import MemberSuccession, passed_member_key
from hearth.events.models import EventEnvelope, MemberAdded, MemberRemoved
from hearth.events.signing import EventVerifier, RejectionReason, StreamPosition
from hearth.events.steward_keys import Succession, passed_steward_key
from hearth.readmodels.batch_rows import (
    MEMBER_ADDITIONS,
    MEMBER_KEYS,
    MEMBER_REMOVALS,
    PIPELINES,
    STEWARD_KEYS,
    BatchRows,
    epoch_s,
)

if TYPE_CHECKING:
    from hearth.events.consume import SkippedMessage, StoredEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rejection:
    """One event a batch did not apply, and why (counted in rejected_event_counts, perhaps kept in rejected_events)."""

    stream: str
    seq: int
    event_type: str
    reason: RejectionReason


def rejection(verifier: EventVerifier | None, message: StoredEvent, rows: BatchRows) -> RejectionReason | None:
    """Why `message` must not be applied (None: apply it; always None without a verifier, an open mesh)."""
    if verifier is None:
        return None
    return _verdict(verifier.rejection, message.event, message, rows) or pipeline_of_another(message.event, rows)


def newer_rejection(verifier: EventVerifier | None, message: SkippedMessage, rows: BatchRows
                    ) -> RejectionReason | None:
    """Why `message`, an event only a newer hearth reads, is no member's (unsigned, an unknown or removed signer,
    a bad signature), None when a member signed it or without a verifier: what its type's rules are, only the newer
    hearth knows (EventVerifier.signature_rejection)."""
    envelope = message.newer.envelope if message.newer is not None else None
    if verifier is None or envelope is None:
        return None
    return _verdict(verifier.signature_rejection, envelope, message, rows)


def _verdict(check: Callable[..., RejectionReason | None], event: EventEnvelope,
             message: StoredEvent | SkippedMessage, rows: BatchRows) -> RejectionReason | None:
    """`check` (one of EventVerifier's) on `event`, stored as `message`, after what `rows` hold of its stream's log."""
    removal_logged = event.signer is not None and rows.get(MEMBER_REMOVALS, (message.stream, event.signer)) is not None
    # The broker's storage time and position (not this process's clock), so a replay of the log rejects exactly
    # what the live projection rejected.
    return check(event, received_at=message.time, stored_data=message.data,
                 position=StreamPosition(message.stream, message.seq, message.subject),
                 removal_logged=removal_logged,
                 steward_succession=steward_succession(message.stream, rows),
                 member_succession=member_succession(message.stream, rows),
                 member_addition=member_addition(message.stream, rows))


def pipeline_of_another(event: object, rows: BatchRows) -> RejectionReason | None:
    """`node_mismatch` for a pipeline event about a pipeline another orchestrator built (its row says whose)."""
    if not getattr(event, "type", "").startswith("pipeline."):
        return None
    pipeline = rows.get(PIPELINES, event.pipeline_id)  # type: ignore[attr-defined]
    if pipeline is not None and pipeline["orchestrator_node_id"] != event.node_id:  # type: ignore[attr-defined]
        return "node_mismatch"
    return None


def steward_succession(stream: str, rows: BatchRows) -> Succession:
    """The steward keys `stream`'s log named so far (steward_keys): each with the one it succeeded."""
    def succeeded(public_key: str) -> str | None:
        row = rows.get(STEWARD_KEYS, (stream, public_key))
        return row["succeeds"] if row is not None else None
    return succeeded


def member_succession(stream: str, rows: BatchRows) -> MemberSuccession:
    """The member keys `stream`'s log named so far (member_keys): each with the one it succeeded and its member."""
    def succeeded(public_key: str) -> tuple[str, str] | None:
        row = rows.get(MEMBER_KEYS, (stream, public_key))
        return (row["succeeds"], row["member"]) if row is not None else None
    return succeeded


def member_addition(stream: str, rows: BatchRows) -> AdditionLookup:
    """The members `stream`'s log added so far (member_additions), by key."""
    def added(public_key: str) -> LoggedAddition | None:
        row = rows.get(MEMBER_ADDITIONS, (stream, public_key))
        if row is None:
            return None
        return LoggedAddition(row["member"], row["role"], row["trust"],
                              datetime.fromtimestamp(row["added_at"], timezone.utc))
    return added


def record_member_addition(event: MemberAdded, rows: BatchRows) -> None:
    """Keep the first addition of a key and of a name on its stream (the verifier has checked that it is stored
    there, signed by a steward key); one of a key or name the stream already knows is ignored."""
    stream = event.stream
    added = logged_addition(event, lambda key: held_here(stream, key, rows), lambda name: any(
        row["stream"] == stream for row in rows.where(MEMBER_ADDITIONS, "member", name)))
    if added is None:
        return
    rows.put(MEMBER_ADDITIONS, (stream, event.public_key), dict(
        stream=stream, public_key=event.public_key, member=added.member, role=added.role, trust=added.trust,
        event_id=event.event_id, added_at=epoch_s(added.added_at)))


def record_member_removal(event: MemberRemoved, rows: BatchRows) -> None:
    """Keep the first removal of a key on its stream (the verifier has checked that it is stored there): a copy
    published later moves the cut nowhere."""
    key = (event.stream, event.public_key)
    if rows.get(MEMBER_REMOVALS, key) is not None:
        return
    rows.put(MEMBER_REMOVALS, key, dict(stream=event.stream, public_key=event.public_key, member=event.member,
                                        event_id=event.event_id,
                                        removed_at=math.floor(event.occurred_at.timestamp())))
    record_steward_key(event, rows)
    record_member_key(event, rows)


def record_steward_key(event: MemberRemoved, rows: BatchRows) -> None:
    """Keep the key the steward's first rotation of its own key on this stream names (none for another event)."""
    passed = passed_steward_key(event, lambda key: held_here(event.stream, key, rows))
    if passed is None:
        return
    new_key, succeeds = passed
    rows.put(STEWARD_KEYS, (event.stream, new_key), dict(stream=event.stream, public_key=new_key, succeeds=succeeds,
                                                         event_id=event.event_id,
                                                         rotated_at=epoch_s(event.occurred_at)))


def record_member_key(event: MemberRemoved, rows: BatchRows) -> None:
    """Keep the key the first rotation of a member's key (not the steward's) on this stream names."""
    passed = passed_member_key(event, lambda key: held_here(event.stream, key, rows))
    if passed is None:
        return
    new_key, succeeds, member = passed
    rows.put(MEMBER_KEYS, (event.stream, new_key), dict(stream=event.stream, public_key=new_key, member=member,
                                                        succeeds=succeeds, event_id=event.event_id,
                                                        rotated_at=epoch_s(event.occurred_at)))


def held_here(stream: str, public_key: str, rows: BatchRows) -> bool:
    """Whether `stream`'s log already retired `public_key`, named it as a steward's or member's key, or added it."""
    return any(rows.get(table, (stream, public_key)) is not None for table in (MEMBER_REMOVALS, STEWARD_KEYS,
                                                                             MEMBER_KEYS, MEMBER_ADDITIONS))

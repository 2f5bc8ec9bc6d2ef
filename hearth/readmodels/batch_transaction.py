"""Applies one batch of stream messages to a read model in one transaction and tells which of them it applied: those
past the stored position of their stream, the rejected among them apart."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from hearth.events.consume import SkippedMessage, StoredEvent
from hearth.events.signing import RejectionReason
from hearth.readmodels.projection import ReadModelProjection, Rejection, load_positions

Message = StoredEvent | SkippedMessage


@dataclass
class AppliedBatch:
    """What one committed transaction did: the messages that moved a position, the events it refused, and the types
    of the events it applied (not refused), one entry per event."""

    newly_applied: list[Message] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    applied_types: list[str] = field(default_factory=list)


def apply_in_one_transaction(session_factory: Callable[[], Session], projection: ReadModelProjection,
                             batch: Sequence[Message], reject_as: RejectionReason | None) -> AppliedBatch:
    """`batch` applied by `projection` in one committed transaction (with `reject_as`, every event not applied before
    is recorded as rejected for that reason instead: readmodels.unapplicable)."""
    outcome = AppliedBatch()
    with session_factory() as session, session.begin():
        positions = load_positions(session, projection.name)
        projection.apply_many(session, batch, rejections=outcome.rejections, reject_as=reject_as)
    # The same rule apply_many follows, to tell which messages this transaction actually applied.
    rejected = {(rejection.stream, rejection.seq) for rejection in outcome.rejections}
    for message in batch:
        if message.seq > positions.get(message.stream, 0):
            outcome.newly_applied.append(message)
            positions[message.stream] = message.seq
            if isinstance(message, StoredEvent) and (message.stream, message.seq) not in rejected:
                outcome.applied_types.append(message.event.type)
    return outcome

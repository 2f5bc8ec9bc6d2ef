"""The keys an event log's verified removals retired and the steward keys its rotations named, per stream, read in
stream order: what a reader without a read model (hearth-replay, the applied-ids backfill, a call and open check)
tells an event's verdict by, as a projection does from its member_removals and steward_keys tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hearth.events.models import MemberRemoved
from hearth.events.signing import EventVerifier, RejectionReason, StreamPosition
from hearth.events.steward_keys import Succession, passed_steward_key


@dataclass
class LoggedKeys:
    """The keys the verified removals and steward rotations read so far retired, and the steward keys they named."""

    removed: set[tuple[str, str]] = field(default_factory=set)  # (stream, key)
    steward_keys: dict[tuple[str, str], str] = field(default_factory=dict)  # (stream, key) -> the key it succeeded

    def record(self, event: MemberRemoved) -> None:
        """Keep a verified removal (or rotation) read in stream order; only the first of a key on a stream counts."""
        stream = event.stream
        if (stream, event.public_key) in self.removed:
            return
        self.removed.add((stream, event.public_key))
        passed = passed_steward_key(event, lambda key: (stream, key) in self.removed or (stream, key) in
                                    self.steward_keys)
        if passed is not None:
            self.steward_keys[(stream, passed[0])] = passed[1]

    def removal_logged(self, stream: str, signer: str | None) -> bool:
        return (stream, signer) in self.removed

    def succession(self, stream: str) -> Succession:
        """The steward keys `stream`'s log named so far, for EventVerifier.rejection."""
        return lambda key: self.steward_keys.get((stream, key))

    def rejection(self, verifier: EventVerifier, message: Any) -> RejectionReason | None:
        """`verifier`'s verdict on a stored event (a StoredEvent) read after what was recorded so far, at the
        broker's storage time and position, as a live projection gives it."""
        event = message.event
        return verifier.rejection(event, received_at=message.time, stored_data=getattr(message, "data", b""),
                                  position=StreamPosition(message.stream, message.seq, message.subject),
                                  removal_logged=self.removal_logged(message.stream, event.signer),
                                  steward_succession=self.succession(message.stream))

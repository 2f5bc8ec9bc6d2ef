"""The keys an event log's verified removals retired, the steward and member keys its rotations named and the members
its additions added, per stream, read in stream order: what a reader without a read model (hearth-replay, the
applied-ids backfill, a call and open check) tells an event's verdict by, as a projection does from its
member_removals, steward_keys, member_keys and member_additions tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hearth.events.member_additions import AdditionLookup, LoggedAddition, logged_addition
from hearth.events.member_keys import MemberSuccession, passed_member_key
from hearth.events.models import MemberChange, MemberRemoved
from hearth.events.signing import EventVerifier, RejectionReason, StreamPosition
from hearth.events.steward_keys import Succession, passed_steward_key


@dataclass
class LoggedKeys:
    """The keys the verified removals and rotations read so far retired, and the steward and member keys they named."""

    removed: set[tuple[str, str]] = field(default_factory=set)  # (stream, key)
    steward_keys: dict[tuple[str, str], str] = field(default_factory=dict)  # (stream, key) -> the key it succeeded
    # (stream, key) -> (the key it succeeded, the member it was rotated for)
    member_keys: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    additions: dict[tuple[str, str], LoggedAddition] = field(default_factory=dict)  # (stream, key) -> its addition

    # (stream, member) of each addition above: what a later addition's name is checked against, kept as they are
    # recorded, so that a log's or kept file's thousands of changes are each checked by lookups.
    _added_members: set[tuple[str, str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._added_members = {(stream, addition.member) for (stream, _), addition in self.additions.items()}

    def held_here(self, stream: str, key: str) -> bool:
        """Whether `stream`'s log so far retired `key`, named it (a rotation) or added it."""
        return any((stream, key) in held for held in (self.removed, self.steward_keys, self.member_keys,
                                                       self.additions))

    def would_add(self, event: MemberChange) -> LoggedAddition | None:
        """What `event`, verified, adds where this stands (member_additions.logged_addition): None for a removal or
        rotation, and for an addition of a key or name its stream already knows."""
        stream = event.stream
        return logged_addition(event, lambda key: self.held_here(stream, key),
                               lambda name: (stream, name) in self._added_members)

    def record(self, event: MemberChange) -> None:
        """Keep a verified removal, rotation or addition read in stream order; only the first of a key on a stream
        counts."""
        stream = event.stream
        if not isinstance(event, MemberRemoved):
            added = self.would_add(event)
            if added is not None:
                self.additions[(stream, event.public_key)] = added
                self._added_members.add((stream, added.member))
            return
        if (stream, event.public_key) in self.removed:
            return
        self.removed.add((stream, event.public_key))

        def held_here(key: str) -> bool:
            return self.held_here(stream, key)

        passed = passed_steward_key(event, held_here)
        if passed is not None:
            self.steward_keys[(stream, passed[0])] = passed[1]
        member_key = passed_member_key(event, held_here)
        if member_key is not None:
            self.member_keys[(stream, member_key[0])] = member_key[1:]

    def removal_logged(self, stream: str, signer: str | None) -> bool:
        return (stream, signer) in self.removed

    def succession(self, stream: str) -> Succession:
        """The steward keys `stream`'s log named so far, for EventVerifier.rejection."""
        return lambda key: self.steward_keys.get((stream, key))

    def member_succession(self, stream: str) -> MemberSuccession:
        """The member keys `stream`'s log named so far, for EventVerifier.rejection."""
        return lambda key: self.member_keys.get((stream, key))

    def addition(self, stream: str) -> AdditionLookup:
        """The members `stream`'s log added so far, for EventVerifier.rejection."""
        return lambda key: self.additions.get((stream, key))

    def named_additions(self) -> list[tuple[str, LoggedAddition]]:
        """Each addition every stream's log made so far, with the key it added."""
        return [(key, addition) for (_, key), addition in self.additions.items()]

    def named_member_keys(self) -> list[tuple[str, str, str]]:
        """Each member key every stream's log named so far: (it, the key it succeeded, the member)."""
        return [(key, succeeded, member) for (_, key), (succeeded, member) in self.member_keys.items()]

    def rejection(self, verifier: EventVerifier, message: Any) -> RejectionReason | None:
        """`verifier`'s verdict on a stored event (a StoredEvent) read after what was recorded so far, at the
        broker's storage time and position, as a live projection gives it."""
        return self._verdict(verifier.rejection, message.event, message)

    def signature_rejection(self, verifier: EventVerifier, message: Any) -> RejectionReason | None:
        """The same for an event only a newer hearth reads (a SkippedMessage with its envelope): its signature's
        checks alone (EventVerifier.signature_rejection)."""
        return self._verdict(verifier.signature_rejection, message.newer.envelope, message)

    def _verdict(self, check: Any, event: Any, message: Any) -> RejectionReason | None:
        return check(event, received_at=message.time, stored_data=getattr(message, "data", b""),
                     position=StreamPosition(message.stream, message.seq, message.subject),
                     removal_logged=self.removal_logged(message.stream, event.signer),
                     steward_succession=self.succession(message.stream),
                     member_succession=self.member_succession(message.stream),
                     member_addition=self.addition(message.stream))

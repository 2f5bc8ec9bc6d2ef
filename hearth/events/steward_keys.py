"""The steward keys a stream's log names: a verified `member.key_rotated` of the `system` member, signed by the steward
key it retires, passes the steward's role to its `new_public_key` on that stream from there on, so a reader whose
roster still names an older steward key verifies what the new one signs without a new roster copy. The log chains the
keys (each rotation is signed by the key as it stood); a reader follows the chain back to the roster's current steward
key, so a roster that names a later steward key overrides what an older one let a stream name."""

from __future__ import annotations

from collections.abc import Callable

from hearth.events.models import EventEnvelope, MemberKeyRotated
from hearth.trust.roster import SYSTEM_MEMBER, Member, Roster

# A stream's lookup: the steward key that `key` succeeded in that stream's log so far (None: it succeeded none there).
Succession = Callable[[str], str | None]

# The most rotations one chain is followed back through: far more than a community rotates its steward key, and a
# bound on what one event's check costs whatever a read model holds.
max_chain_length = 64


def passed_steward_key(event: EventEnvelope, held_here: Callable[[str], bool]) -> tuple[str, str] | None:
    """(the new steward key, the one it succeeds) when `event`, already verified and the first removal of its key on
    its stream, is the steward's rotation of its own key: of the `system` member, retiring the key that signed it. A
    rotation of another member's key, one whose signer retires some other key, and one naming a key the stream
    already retired or named (`held_here`) pass nothing on."""
    if not isinstance(event, MemberKeyRotated) or event.member != SYSTEM_MEMBER:
        return None
    if event.signer is None or event.signer != event.public_key or held_here(event.new_public_key):
        return None
    return event.new_public_key, event.public_key


def steward_by_log(roster: Roster, public_key: str, succeeded: Succession) -> Member | None:
    """The steward (the roster's `system` member) holding `public_key`, when the stream's log passed the roster's
    current steward key on to it through one rotation or more (`succeeded`). A chain that leads back to a key the
    roster retired instead (its rotation named another successor in this stream than in the roster: a leaked old key
    got there first) names no steward: the roster's own chain is the steward's later word."""
    steward = roster.by_name(SYSTEM_MEMBER)
    if steward is None:
        return None
    key = public_key
    for _ in range(max_chain_length):
        predecessor = succeeded(key)
        if predecessor is None:
            return None
        if predecessor == steward.public_key:
            return steward.model_copy(update={"public_key": public_key, "retired_keys": []})
        key = predecessor
    return None

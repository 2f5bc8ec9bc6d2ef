"""The steward keys a stream's log names: a verified `member.key_rotated` of the `system` member, signed by the steward
key it retires, passes the steward's role to its `new_public_key` on that stream from there on, so a reader whose
roster still names an older steward key verifies what the new one signs without a new roster copy. The log chains the
keys (each rotation is signed by the key as it stood); a reader follows the chain back to the roster's current steward
key, so a roster that names a later steward key overrides what an older one let a stream name. Signed calls and
opens, at no position in a log, follow every stream's chain together (steward_key_for_calls, caller_by_logs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def steward_key_for_calls(steward_key: str, named: Iterable[tuple[str, str]]) -> tuple[str | None, frozenset[str]]:
    """The steward key a signed call or open counts as the steward's, and the keys it retired, from the roster's
    current steward key and the steward keys the streams' logs named (`named`: each with the one it succeeded, every
    stream's together). A call stands at no position in a log: the chain of rotations is followed from the roster's
    key to its end, and each key it passes is retired. A key two streams name different successors of (a leaked key
    got its own rotation into one of them first) is retired, and no key after it is the steward's (None) until a
    roster names one."""
    successors: dict[str, set[str]] = {}
    for new_key, succeeded in named:
        successors.setdefault(succeeded, set()).add(new_key)
    key, retired = steward_key, set()
    for _ in range(max_chain_length):
        following = successors.get(key)
        if not following:
            return key, frozenset(retired)
        retired.add(key)
        if len(following) > 1:
            return None, frozenset(retired)
        (key,) = following
        if key in retired:  # no log chains a key back to itself (passed_steward_key); a bound all the same
            return None, frozenset(retired)
    return None, frozenset(retired)


def caller_by_logs(roster: Roster, public_key: str, named: Iterable[tuple[str, str]]) -> Member | None:
    """The member whose call or open `public_key` signed: the roster's holder of the key, unless the logs retired it
    as the steward's (steward_key_for_calls), or the steward where the logs' chain from the roster's steward key ends
    at it. Only the steward's own keys follow the logs: a key the roster gives another member stays that member's."""
    member = roster.by_key(public_key)
    steward = roster.by_name(SYSTEM_MEMBER)
    if steward is None or (member is not None and member.name != SYSTEM_MEMBER):
        return member
    current, retired = steward_key_for_calls(steward.public_key, named)
    if public_key in retired:
        return None
    if member is not None:
        return member
    if public_key == current:
        return steward.model_copy(update={"public_key": public_key, "retired_keys": []})
    return None

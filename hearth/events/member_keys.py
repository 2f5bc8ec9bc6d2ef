"""The member keys a stream's log names: a verified `member.key_rotated` of a member other than the steward (signed by
a steward key, as every rotation must verify) passes that member's role to its `new_public_key` on that stream from
there on, so a reader whose roster still names the member's older key verifies what the new one signs without a new
roster copy. A reader follows the chain of the member's rotations back to the key its roster gives that member now:
a roster that names yet another key for it (the log and the roster disagree) wins, and the log's key names no one
(fail closed). A member the roster copy does not name at all is followed back to the key the same log's addition
gave it (hearth/events/member_additions.py), so a member added and then given a new key through the log alone is
followed as a rostered one is; a chain that leads to no such addition, or to one of another member, names no one.
Signed calls and opens, at no position in a log, follow every stream's chain together (member_by_logs,
current_key_by_logs); the steward's own rotations are hearth/events/steward_keys.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hearth.events.member_additions import (
    AdditionLookup, LoggedAddition, member_by_addition, member_named_by_additions,
)
from hearth.events.models import EventEnvelope, MemberKeyRotated
from hearth.events.steward_keys import max_chain_length, steward_key_for_calls
from hearth.trust.roster import SYSTEM_MEMBER, Member, Roster

# A stream's lookup: (the key `key` succeeded in that stream's log so far, the member the rotation named); None: it
# succeeded none there.
MemberSuccession = Callable[[str], tuple[str, str] | None]

# What the logs named, every stream's together: (the new key, the key it succeeded, the member it was rotated for).
NamedMemberKey = tuple[str, str, str]


def passed_member_key(event: EventEnvelope, held_here: Callable[[str], bool]) -> NamedMemberKey | None:
    """(the new key, the one it succeeds, the member) when `event`, already verified (a steward signed it) and the
    first removal of its key on its stream, rotates a member's key other than the steward's. One naming a key the
    stream already retired or named (`held_here`) passes nothing on."""
    if not isinstance(event, MemberKeyRotated) or event.member == SYSTEM_MEMBER:
        return None
    if event.new_public_key == event.public_key or held_here(event.new_public_key):
        return None
    return event.new_public_key, event.public_key, event.member


def member_by_log(roster: Roster, public_key: str, succeeded: MemberSuccession,
                  added: AdditionLookup | None = None) -> Member | None:
    """The member whose key the stream's log passed on to `public_key`, through one rotation or more of that member
    (`succeeded`), starting from the key the roster gives it now, or, for a member the roster does not name, from the
    key the stream's log added it under (`added`). A chain through another member's rotation, one that leads back to
    a key the roster retired or never gave that member (the roster says otherwise), or, for a member the roster does
    not name, to no addition of it, names no one."""
    key, named = public_key, None
    for _ in range(max_chain_length):
        step = succeeded(key)
        if step is None:
            return None
        predecessor, member_name = step
        if named is not None and member_name != named:
            return None
        named = member_name
        member = roster.by_name(member_name)
        if member is None:
            member = member_by_addition(roster, predecessor, added(predecessor)) if added is not None else None
            if member is not None and member.name != member_name:
                return None  # the key was added as another member
            if member is None:
                key = predecessor
                continue
        if member.name == SYSTEM_MEMBER:
            return None
        if predecessor == member.public_key:
            return member.model_copy(update={"public_key": public_key, "retired_keys": []})
        key = predecessor
    return None


def current_key_by_logs(member: Member, named: Iterable[NamedMemberKey]) -> tuple[str | None, frozenset[str]]:
    """The key a signed call or open of `member` (as the roster gives it) counts by, and the keys it retired, from
    the member keys every stream's log named: the chain of its rotations followed from the roster's key to its end.
    A key two streams name different successors of leaves no key counting (None) until a roster names one."""
    return steward_key_for_calls(member.public_key, [(new_key, succeeded) for new_key, succeeded, name in named
                                                     if name == member.name])


def member_by_logs(roster: Roster, public_key: str, named: Iterable[NamedMemberKey],
                   additions: Iterable[tuple[str, LoggedAddition]] = ()) -> Member | None:
    """The member whose call or open `public_key` signed when the roster does not give it that key: the one the logs'
    chain of rotations from its roster key, or from the key the logs' additions gave a member the roster does not
    name (`additions`), ends at `public_key` (every stream's together)."""
    named = list(named)
    names = {name for new_key, _, name in named if new_key == public_key}
    if len(names) != 1:
        return None  # named by no rotation, or for two members: fail closed
    name = names.pop()
    member = roster.by_name(name) or member_named_by_additions(roster, name, additions)
    if member is None or member.name == SYSTEM_MEMBER:
        return None
    current, _ = current_key_by_logs(member, named)
    if current != public_key:
        return None
    return member.model_copy(update={"public_key": public_key, "retired_keys": []})

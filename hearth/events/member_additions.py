"""The members a stream's log adds: a verified `member.added` (signed by a steward key, as its type requires) makes
its `public_key` a member of that name, role and trust on that stream from its position on, as the roster the steward
saved with it would, so a reader whose roster copy does not name the member yet takes what it signs there and its
calls and opens (every stream's additions together: member_by_additions). An addition of a name or key the roster or
the log already knows otherwise names no one (fail closed): the roster's word, and the log's first, stand. A later
removal of the key wins as any removal does (it retires the key)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import NamedTuple

from hearth.events.models import EventEnvelope, MemberAdded
from hearth.trust.roster import ROLES, SYSTEM_MEMBER, Member, Roster, TrustLevel

log = logging.getLogger(__name__)


class LoggedAddition(NamedTuple):
    """What a verified addition on one stream says of its key: the member, its role and trust, and when the steward
    added it (the roster's `added_at`)."""

    member: str
    role: str
    trust: TrustLevel
    added_at: datetime


# A stream's lookup: the addition that named `key` in that stream's log so far (None: none did).
AdditionLookup = Callable[[str], LoggedAddition | None]


def logged_addition(event: EventEnvelope, key_held_here: Callable[[str], bool],
                    name_held_here: Callable[[str], bool]) -> LoggedAddition | None:
    """What `event`, already verified (a steward signed it), adds on its stream: None for another event, and for an
    addition of a key the stream already holds (added, retired or named by a rotation: `key_held_here`) or of a
    name it already added (`name_held_here`), which is ignored with one line."""
    if not isinstance(event, MemberAdded):
        return None
    if event.member == SYSTEM_MEMBER or event.role not in ROLES:  # the model refuses both; a bound all the same
        return None
    if key_held_here(event.public_key) or name_held_here(event.member):
        log.warning("the addition %s of %s on %s is ignored: that stream's log already knows its key or name",
                    event.event_id, event.member, event.stream)
        return None
    return LoggedAddition(event.member, event.role, event.trust, event.occurred_at)


def member_by_addition(roster: Roster, public_key: str, addition: LoggedAddition | None) -> Member | None:
    """The member `addition` makes of `public_key`, unless the roster already knows its name or its key (under
    another key or member, or removed, or retired): then the roster's word stands and the addition names no one."""
    if addition is None or addition.member == SYSTEM_MEMBER or addition.role not in ROLES:
        return None
    if roster.by_name(addition.member) is not None or roster.by_key(public_key) is not None:
        return None
    if any(gone.member.name == addition.member for gone in roster.removed) or public_key in roster.former_keys():
        return None
    return Member(name=addition.member, role=addition.role, trust=addition.trust,  # type: ignore[arg-type]
                  public_key=public_key, added_at=addition.added_at)


def member_by_additions(roster: Roster, public_key: str,
                        named: Iterable[tuple[str, LoggedAddition]]) -> Member | None:
    """The member whose call or open `public_key` signed when the roster does not name it: the one every stream's
    log added under it (`named`: each addition with its key, every stream's together). Streams that add the key as
    different members, roles or trust, or the member under another key, name no one (fail closed)."""
    named = list(named)
    of_key = {(addition.member, addition.role, addition.trust) for key, addition in named if key == public_key}
    if len(of_key) != 1:
        return None
    ((member, _, _),) = of_key
    if any(key != public_key for key, addition in named if addition.member == member):
        return None
    first = min((addition for key, addition in named if key == public_key), key=lambda addition: addition.added_at)
    return member_by_addition(roster, public_key, first)


def member_named_by_additions(roster: Roster, name: str,
                              named: Iterable[tuple[str, LoggedAddition]]) -> Member | None:
    """The member `name` as the logs' additions make it (member_by_additions) when the roster does not name it: what
    routing and the keys hop keys are sealed to go by for a node the roster copy does not know yet."""
    named = list(named)
    keys = {key for key, addition in named if addition.member == name}
    return member_by_additions(roster, keys.pop(), named) if len(keys) == 1 else None

"""A log, or a kept file, of many member changes (additions, removals, rotations, as a process's start reads up to
max_kept_removals of them) teaches what it teaches one change at a time: an addition of a name or a key its stream
already knows names no one, the same member added on another stream counts there, a removal after an addition retires
the key and leaves the addition, and a rotation to a key the stream already holds passes nothing on. LoggedKeys keeps
its stream's added names indexed as it records, so a start checks each addition by lookups (before, against a copy of
every change read so far and a pass over every addition)."""

from __future__ import annotations

import itertools

from hearth.events.logged_keys import LoggedKeys
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.services.common.kept_steward_keys import (
    KeptRemoval, counts_on_its_stream, in_stream_order, trusted_removals,
)
from hearth.trust.keys import MemberKey
from tests.unit.test_kept_retired_keys import verifier
from tests.unit.test_member_added_from_the_log import addition
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_from_the_log import STEWARD_0, removal_of, rotation

MEMBERS = 120  # six kinds of edge case, twenty of each, among some 300 changes


def many_changes():
    """The changes of a log, each with whether it counts, and the additions, retired keys and member keys it
    leaves."""
    keys = [MemberKey.generate() for _ in range(MEMBERS)]
    clock = itertools.count(10)
    changes, additions, removed, member_keys = [], {}, set(), {}

    def add(name: str, key: MemberKey, *, counts: bool, stream: str = SHARDS_STREAM) -> None:
        changes.append((addition(name, key, role="client", trust="member", t=next(clock), stream=stream), counts))
        if counts:
            additions[(stream, key.public_key)] = name

    for index, key in enumerate(keys):
        name = f"added-{index}"
        add(name, key, counts=True)
        case = index % 6
        if case == 0 and index > 0:  # a rotation to a key the stream added: its old key retired, nothing named
            changes.append((rotation(key, keys[index - 1], signer=STEWARD_0, member=name, t=next(clock)), True))
            removed.add((SHARDS_STREAM, key.public_key))
        elif case == 1:  # a name added twice: the second names no one, and holds neither its key nor its name
            fresh = MemberKey.generate()
            add(name, fresh, counts=False)
            add(f"fresh-{index}", fresh, counts=True)
        elif case == 2:  # one key, two members: the second names no one
            add(f"twin-{index}", key, counts=False)
            add(f"twin-{index}", MemberKey.generate(), counts=True)
        elif case == 3:  # a removal after the addition: the key retired, the addition stays, neither added again
            changes.append((removal_of(name, key, by=STEWARD_0, t=next(clock)), True))
            removed.add((SHARDS_STREAM, key.public_key))
            add(f"again-{index}", key, counts=False)
            add(name, MemberKey.generate(), counts=False)
        elif case == 4:  # the same member on another stream: it counts there
            add(name, key, counts=True, stream=PIPELINES_STREAM)
        elif case == 5:  # a rotation to a new key: named, so no addition of that key counts
            new_key = MemberKey.generate()
            changes.append((rotation(key, new_key, signer=STEWARD_0, member=name, t=next(clock)), True))
            removed.add((SHARDS_STREAM, key.public_key))
            member_keys[(SHARDS_STREAM, new_key.public_key)] = (key.public_key, name)
            add(f"late-{index}", new_key, counts=False)
    return changes, additions, removed, member_keys


def taught(logged: LoggedKeys):
    return ({where: addition.member for where, addition in logged.additions.items()}, logged.removed,
            logged.member_keys, logged.steward_keys)


def test_recording_many_changes_gives_what_each_teaches_alone():
    changes, additions, removed, member_keys = many_changes()
    logged = LoggedKeys()
    for event, counts in changes:
        assert counts_on_its_stream(logged, event) == counts, event
        logged.record(event)
    assert taught(logged) == (additions, removed, member_keys, {})


def test_a_kept_file_of_many_changes_teaches_what_its_log_did():
    changes, additions, removed, member_keys = many_changes()
    kept = [KeptRemoval.of(stored(event, seq, stream=event.stream)) for seq, (event, _) in enumerate(changes, 1)]
    logged, counted = trusted_removals(verifier(), kept)
    assert taught(logged) == (additions, removed, member_keys, {})
    assert counted == in_stream_order(entry for entry, (_, counts) in zip(kept, changes, strict=True) if counts)

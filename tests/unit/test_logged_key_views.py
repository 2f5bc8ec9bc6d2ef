"""What a process with no read model asks of the keys the logs retired, named and added is built once and kept until
a new removal, rotation or addition is read (not on every call and step, as before: a pass over every change the logs
and the kept file hold); a change read that does not count leaves it as it was. Its lookups of one key or member
answer as the whole lists do, where two streams disagree too."""

from __future__ import annotations

import asyncio

from hearth.events.logged_keys import LoggedKeys
from hearth.events.member_additions import LoggedAddition, member_by_additions, member_named_by_additions
from hearth.events.member_keys import current_key_by_logs, member_by_logs
from hearth.events.signing import EventVerifier
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.services.common import logged_steward_keys
from hearth.services.common.logged_key_views import LoggedKeyViews
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.trust.keys import MemberKey
from tests.readmodel_helpers import at
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_from_the_log import ATTIC, HUB, SKEW_S, STEWARD_0, old_roster, removal_of, rotation

ATTIC_2, ATTIC_3, GARAGE, GARAGE_2, STRANGER, YARD, YARD_2 = (MemberKey.generate() for _ in range(7))


def test_the_views_are_built_again_when_a_change_is_read_and_not_otherwise(monkeypatch):
    attic_rotated = stored(rotation(ATTIC, ATTIC_2, member="attic", signer=STEWARD_0, t=20), 1)
    arrivals: asyncio.Queue = asyncio.Queue()
    taken: list[int] = []  # each message's seq once the follower asked for the next: it has read it

    async def read_stream(js, stream, *, from_seq=1, follow=False, **_):
        for message in [attic_rotated] if from_seq <= 1 else []:
            yield message
            taken.append(message.seq)
        while follow:
            message = await arrivals.get()
            yield message
            taken.append(message.seq)

    monkeypatch.setattr(logged_steward_keys, "read_stream", read_stream)
    follower = StewardKeysFromTheLog(None, EventVerifier(old_roster(), max_clock_skew_s=SKEW_S), (SHARDS_STREAM,))

    async def read(*messages) -> None:
        for message in messages:
            arrivals.put_nowait(message)
        async with asyncio.timeout(10):
            while taken[-1:] != [messages[-1].seq]:
                await asyncio.sleep(0.01)

    async def run() -> None:
        await follower.start(catch_up_timeout_s=5.0)
        try:
            first = follower.views()
            assert follower.views() is first and follower.retired_keys() is first.retired
            assert first.retired == {ATTIC.public_key}
            assert first.member_keys_of("attic") == ((ATTIC_2.public_key, ATTIC.public_key, "attic"),)

            await read(stored(removal_of("hub", HUB, by=HUB, t=30), 2),  # forged: a hub is no steward
                       stored(rotation(ATTIC, ATTIC_3, member="attic", signer=STEWARD_0, t=31), 3))  # ATTIC again
            assert follower.views() is first

            await read(stored(removal_of("hub", HUB, by=STEWARD_0, t=40), 4))
            changed = follower.views()
            assert changed is not first and follower.views() is changed
            assert changed.retired == {ATTIC.public_key, HUB.public_key} == follower.retired_keys()
            assert follower.member_keys() == [(ATTIC_2.public_key, ATTIC.public_key, "attic")]
        finally:
            await follower.stop()

    asyncio.run(run())


def added(name: str, role: str = "shard", trust: str = "trusted") -> LoggedAddition:
    return LoggedAddition(name, role, trust, at(10))  # type: ignore[arg-type]


def test_a_lookup_of_one_key_or_member_answers_as_every_change_does():
    shards = {(SHARDS_STREAM, ATTIC_2.public_key): (ATTIC.public_key, "attic"),
              (SHARDS_STREAM, ATTIC_3.public_key): (ATTIC_2.public_key, "attic"),
              (SHARDS_STREAM, YARD_2.public_key): (YARD.public_key, "yard")}  # a member only the log added
    forked = {(PIPELINES_STREAM, STRANGER.public_key): (ATTIC_2.public_key, "attic")}  # another successor of ATTIC_2
    additions = {(SHARDS_STREAM, YARD.public_key): added("yard"),
                 (SHARDS_STREAM, GARAGE.public_key): added("garage"),
                 (PIPELINES_STREAM, GARAGE_2.public_key): added("garage"),      # garage under two keys
                 (SHARDS_STREAM, HUB.public_key): added("phone", "client"),     # a key the roster gives hub
                 (SHARDS_STREAM, STRANGER.public_key): added("tablet", "client"),
                 (PIPELINES_STREAM, STRANGER.public_key): added("watch", "client")}  # one key, two members
    roster = old_roster()
    attic = roster.by_name("attic")
    keys = [key.public_key for key in (ATTIC, ATTIC_2, ATTIC_3, GARAGE, GARAGE_2, HUB, STRANGER, STEWARD_0, YARD,
                                        YARD_2)]
    answers = []
    for member_keys in (shards, {**shards, **forked}):
        views = LoggedKeyViews.of(LoggedKeys(member_keys=dict(member_keys)), LoggedKeys(additions=additions))
        every_rotation, every_addition = list(views.member_keys), list(views.additions)
        for key in keys:
            answers.append(member_by_logs(roster, key, views.member_keys_bearing_on(key),
                                          views.additions_bearing_on_signer(key)))
            assert answers[-1] == member_by_logs(roster, key, every_rotation, every_addition)
            answers.append(member_by_additions(roster, key, views.additions_bearing_on(key)))
            assert answers[-1] == member_by_additions(roster, key, every_addition)
        answers.append(current_key_by_logs(attic, views.member_keys_of("attic"))[0])
        assert answers[-1] == current_key_by_logs(attic, every_rotation)[0]
        for name in ("yard", "garage", "phone", "tablet", "watch", "attic"):
            answers.append(member_named_by_additions(roster, name, views.additions_bearing_on_member(name)))
            assert answers[-1] == member_named_by_additions(roster, name, every_addition)
    # Named and not: where a lookup that missed an entry would answer otherwise.
    assert {getattr(answer, "name", answer) for answer in answers} == {None, "attic", "yard", ATTIC_3.public_key}
    assert member_by_logs(roster, YARD_2.public_key, views.member_keys_bearing_on(YARD_2.public_key),
                          views.additions_bearing_on_signer(YARD_2.public_key)).name == "yard"

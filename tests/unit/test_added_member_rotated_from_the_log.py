"""A member added through the log and then given a new key through the log is followed by a household whose roster copy
names neither: the steward's `member.added` of garage, then its `member.key_rotated` to a new key, make the new key
garage's on that stream from the rotation on, in a live projection (across restarts), a rebuild, hearth-replay, and
for signed calls and opens, routing's membership check and the keys an open is sealed to. Before, the rotation was
followed only from a key the roster gave its member, so everything garage's new key signed was `unknown_signer` until
the household had a new roster copy. Where the log and the roster disagree (the roster removed garage, or the chain
leads to another member's addition) the new key names no one."""

from __future__ import annotations

import asyncio

from hearth.events.logged_keys import LoggedKeys
from hearth.events.signing import EventVerifier, sign_event
from hearth.readmodels.rebuild import diff_databases
from hearth.services.common import event_trust
from hearth.services.common.call_signing import CallVerifier
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.services.replay.verify import PassedEvents, _verdict
from hearth.events.streams import SHARDS_STREAM
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member
from tests.readmodel_helpers import at
from tests.unit.test_applied_backfill_steward_keys import fake_read_stream
from tests.unit.test_member_added_from_the_log import (GARAGE, addition, added, community_settings, garage_advert,
                                                       garage_beat)
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_for_calls import caller
from tests.unit.test_steward_key_from_the_log import HUB, SKEW_S, STEWARD_0, old_roster, project, removal_of, rotation

GARAGE_2, GARAGE_3 = MemberKey.generate(), MemberKey.generate()


def garage_rotation(old: MemberKey, new: MemberKey, *, t: float, member: str = "garage"):
    return rotation(old, new, signer=STEWARD_0, member=member, t=t)


def added_then_rotated_log():
    events = [
        addition("garage", GARAGE, t=10),                          # 1 the steward adds garage
        garage_advert(GARAGE, 15),                                 # 2 garage's: applied
        garage_rotation(GARAGE, GARAGE_2, t=20),                   # 3 the steward rotates garage's key
        garage_beat(GARAGE, 25),                                   # 4 the old key after it
        garage_beat(GARAGE_2, 30),                                 # 5 the new key: garage's
        garage_rotation(GARAGE_2, GARAGE_3, t=35),                 # 6 and once more
        garage_beat(GARAGE_2, 40),                                 # 7
        garage_beat(GARAGE_3, 45),                                 # 8 garage's
        garage_rotation(HUB, MemberKey.generate(), t=50, member="hub"),  # 9 another member's rotation
    ]
    return [stored(event, seq) for seq, event in enumerate(events, 1)]


EXPECTED = [(4, "removed_signer"), (7, "removed_signer")]


def test_a_projector_with_the_old_roster_follows_the_added_members_rotations_across_restarts(tmp_path):
    log = added_then_rotated_log()
    rejected, removals = project(tmp_path / "live.db", old_roster(), [log[:3], log[3:6], log[6:]])
    assert rejected == EXPECTED  # 5 and 8 were unknown_signer, for good
    assert {("garage", GARAGE.public_key), ("garage", GARAGE_2.public_key)} <= removals


def test_a_rebuild_with_the_old_roster_equals_the_live_projection_and_so_does_hearth_replay(tmp_path):
    log = added_then_rotated_log()
    live, rebuilt = tmp_path / "live.db", tmp_path / "rebuilt.db"
    project(live, old_roster(), [log[:4], log[4:]])
    rejected, _ = project(rebuilt, old_roster(), [log])
    assert rejected == EXPECTED and diff_databases(rebuilt, live) == []
    logged, passed = LoggedKeys(), PassedEvents(None)
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    verdicts = [_verdict(verifier, message, logged, passed) for message in log]
    assert [(bad.seq, bad.reason) for bad in verdicts if bad is not None] == EXPECTED


def test_a_rotation_whose_chain_leads_to_another_members_addition_or_a_roster_that_removed_it_names_no_one(tmp_path):
    log = added_then_rotated_log()
    # The rotation says it is phone's key, the addition garage's: the log contradicts itself.
    contradicting = [*log[:2], stored(garage_rotation(GARAGE, GARAGE_2, t=20, member="phone"), 3), log[4]]
    rejected, _ = project(tmp_path / "contradicting.db", old_roster(), [contradicting])
    assert (5, "unknown_signer") in rejected
    # The household's roster copy removed garage meanwhile: the log's keys for it name no one.
    roster = old_roster().with_member(new_member("garage", "shard", GARAGE.public_key)).without_member(
        "garage", removed_at=at(12))
    rejected, _ = project(tmp_path / "removed.db", roster, [log[:5]])
    assert (5, "unknown_signer") in rejected


def rotated(new: MemberKey, old: MemberKey, member: str = "garage") -> tuple[str, str, str]:
    return new.public_key, old.public_key, member


def test_calls_and_opens_of_an_added_members_new_key_are_its_by_the_log_alone():
    def verifier(additions, rotations, retired=(GARAGE.public_key,)) -> CallVerifier:
        return CallVerifier(old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                            logged_retired_keys=lambda: retired, logged_member_keys=lambda signer: rotations,
                            logged_member_additions=lambda signer: additions)

    garage = [added("garage", GARAGE)]
    assert caller(verifier(garage, [rotated(GARAGE_2, GARAGE)]), GARAGE_2) == "garage"
    assert caller(verifier(garage, [rotated(GARAGE_2, GARAGE)]), GARAGE) == "unknown_signer"  # retired
    assert caller(verifier(garage, [rotated(GARAGE_2, GARAGE), rotated(GARAGE_3, GARAGE_2)],
                           retired=(GARAGE.public_key, GARAGE_2.public_key)), GARAGE_3) == "garage"
    # The rotation names another member than the addition, or no addition at all: no one.
    assert caller(verifier(garage, [rotated(GARAGE_2, GARAGE, "phone")]), GARAGE_2) == "unknown_signer"
    assert caller(verifier([], [rotated(GARAGE_2, GARAGE)]), GARAGE_2) == "unknown_signer"


def test_the_follower_membership_and_sealing_follow_the_added_members_new_key(tmp_path, monkeypatch):
    import hearth.services.common.logged_steward_keys as logged_steward_keys

    log = added_then_rotated_log()
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    settings = community_settings(tmp_path)

    async def follow(messages) -> tuple[str, str, str | None, str | None]:
        monkeypatch.setattr(logged_steward_keys, "read_stream", fake_read_stream(messages))
        follower = StewardKeysFromTheLog(None, verifier, (SHARDS_STREAM,), tmp_path / "kept.json")
        await follower.start(catch_up_timeout_s=5.0)
        try:
            calls = event_trust.call_verifier(settings, follower)
            opens = event_trust.open_verifier(settings, follower)
            membership = event_trust.node_membership(settings, follower)
            sealed_to = event_trust.member_public_keys(settings, follower)
            return caller(calls, GARAGE_3), caller(opens, GARAGE_3), membership("garage"), sealed_to("garage")
        finally:
            await follower.stop()

    # A shard host calls nothing, but its key is garage's: role_may_not_call, no longer unknown_signer.
    expected = ("role_may_not_call", "garage", None, GARAGE_3.public_key)
    assert asyncio.run(follow(log)) == expected
    assert asyncio.run(follow([])) == expected  # kept: aged out of the log
    removed = [*log, stored(removal_of("garage", GARAGE_3, by=STEWARD_0, t=60), len(log) + 1)]
    refused, _, membership, sealed = asyncio.run(follow(removed))
    assert refused == "unknown_signer" and membership is not None and "removed" in membership and sealed is None


def test_the_chain_needs_the_steward_to_sign_it():
    log = added_then_rotated_log()
    forged = stored(sign_event(garage_rotation(GARAGE, GARAGE_2, t=20).model_copy(update={"node_id": "hub"}), HUB),
                    3)
    verifier, logged = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S), LoggedKeys()
    for message in (log[0], forged):
        if logged.rejection(verifier, message) is None:
            logged.record(message.event)
    assert logged.rejection(verifier, forged) == "role_may_not_emit"
    assert logged.rejection(verifier, log[4]) == "unknown_signer"

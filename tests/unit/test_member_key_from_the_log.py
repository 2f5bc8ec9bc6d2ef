"""A member's key rotation is followed from the log, as the steward's own is: the steward's signed `member.key_rotated`
of attic makes its new key attic's on that stream from there on, in a live projection (across restarts), a rebuild,
hearth-replay, and for signed calls and opens, routing's membership check and the keys an open is sealed to, with a
roster copy that still names attic's old key. Before, everything the new key signed was `unknown_signer` (events
rejected for good, the mesh serving no model) until each household had a new roster copy. A forged rotation teaches
nothing, a rotation on one stream says nothing of another's, and a roster naming yet another key wins."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hearth.events.logged_keys import LoggedKeys
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.readmodels.rebuild import diff_databases
from hearth.services.common import event_trust
from hearth.services.common.call_signing import CallVerifier
from hearth.services.common.config import HearthSettings
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.services.replay.verify import PassedEvents, _verdict
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER, RemovalCut
from tests.readmodel_helpers import advertised, at, heartbeat
from tests.unit.test_applied_backfill_steward_keys import fake_read_stream
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_for_calls import caller
from tests.unit.test_steward_key_from_the_log import (ATTIC, HUB, SHARD_ID, SKEW_S, STEWARD_0, THIEF, old_roster,
                                                      project, removal_of, rotation)
from hearth.protocol.subjects import shard_control_subject

ATTIC_2, ATTIC_3 = MemberKey.generate(), MemberKey.generate()


def beat(key: MemberKey, t: float):
    return sign_event(heartbeat(SHARD_ID, t=t, node="attic", tokens=int(t)), key)


def attic_rotation(old: MemberKey, new: MemberKey, *, t: float, signer: MemberKey = STEWARD_0, node=SYSTEM_MEMBER):
    return rotation(old, new, signer=signer, member="attic", node=node, t=t)


def member_log():
    advert = sign_event(advertised(0, 3, "attic", control_subject=shard_control_subject("attic", SHARD_ID), t=0),
                        ATTIC)
    events = [
        advert,                                                     # 1
        beat(ATTIC_2, 10),                                          # 2 the new key before its rotation
        attic_rotation(ATTIC, ATTIC_2, t=20),                       # 3 the steward rotates attic's key
        beat(ATTIC, 25),                                            # 4 the old key after it
        beat(ATTIC_2, 30),                                          # 5 the new key after it: attic's
        attic_rotation(ATTIC_2, THIEF, t=35, signer=HUB, node="hub"),  # 6 forged: a hub is no steward
        beat(THIEF, 40),                                            # 7
        beat(ATTIC_2, 45),                                          # 8
    ]
    return [stored(event, seq) for seq, event in enumerate(events, 1)]


EXPECTED = [(2, "unknown_signer"), (4, "removed_signer"), (6, "role_may_not_emit"), (7, "unknown_signer")]


def saved_roster(log):
    cut = RemovalCut(stream=SHARDS_STREAM, seq=3, event_id=log[2].event.event_id, stored_at=log[2].time)
    return old_roster().with_rotated_key("attic", ATTIC_2.public_key, retired_at=at(20), cuts=[cut])


def test_a_projector_with_the_old_roster_applies_the_new_keys_events_after_the_rotation_across_restarts(tmp_path):
    log = member_log()
    rejected, removals = project(tmp_path / "live.db", old_roster(), [log[:3], log[3:6], log[6:]])
    assert rejected == EXPECTED  # 5 and 8 were unknown_signer, for good
    assert ("attic", ATTIC.public_key) in removals


def test_a_rebuild_with_the_roster_the_steward_saved_equals_the_live_projection(tmp_path):
    log = member_log()
    live, rebuilt = tmp_path / "live.db", tmp_path / "rebuilt.db"
    project(live, old_roster(), [log[:4], log[4:]])
    rejected, _ = project(rebuilt, saved_roster(log), [log])
    assert rejected == EXPECTED  # the new key's event stored before its rotation too
    assert diff_databases(rebuilt, live) == []


def test_a_rotation_on_another_stream_says_nothing_of_this_one(tmp_path):
    elsewhere = attic_rotation(ATTIC, ATTIC_2, t=20).model_copy(update={"stream": PIPELINES_STREAM})
    log = [stored(sign_event(elsewhere, STEWARD_0), 1, stream=PIPELINES_STREAM)]
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    logged = LoggedKeys()
    assert logged.rejection(verifier, log[0]) is None
    logged.record(log[0].event)
    assert logged.rejection(verifier, stored(beat(ATTIC_2, 30), 2)) == "unknown_signer"


def test_a_roster_naming_yet_another_key_wins_over_the_log(tmp_path):
    """The log rotates attic to ATTIC_2, the roster to ATTIC_3: the log's key names no one (fail closed)."""
    log = member_log()
    cut = RemovalCut(stream=SHARDS_STREAM, seq=3, event_id=log[2].event.event_id)
    other = old_roster().with_rotated_key("attic", ATTIC_3.public_key, retired_at=at(20), cuts=[cut])
    rejected, _ = project(tmp_path / "rm.db", other, [log[:5]])
    assert (5, "unknown_signer") in rejected


def test_hearth_replay_verify_with_the_old_roster_follows_the_members_rotation():
    logged, passed = LoggedKeys(), PassedEvents(None)
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    verdicts = [_verdict(verifier, message, logged, passed) for message in member_log()]
    assert [(bad.seq, bad.reason) for bad in verdicts if bad is not None] == EXPECTED


def named(*rotations: tuple[MemberKey, MemberKey]) -> list[tuple[str, str, str]]:
    return [(new.public_key, old.public_key, "attic") for new, old in rotations]


def test_calls_and_opens_of_the_new_key_are_the_members_by_the_log_alone():
    retired = [ATTIC.public_key]

    def verifier(rotations, roster=None) -> CallVerifier:
        return CallVerifier(roster or old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                            logged_retired_keys=lambda: retired, logged_member_keys=lambda signer: rotations)

    assert caller(verifier(named()), ATTIC_2) == "unknown_signer"  # as before: the roster alone
    assert caller(verifier(named((ATTIC_2, ATTIC))), ATTIC_2) == "attic"
    assert caller(verifier(named((ATTIC_2, ATTIC))), ATTIC) == "unknown_signer"
    # Two streams naming different successors (a leaked steward key's doing): neither counts.
    assert caller(verifier(named((ATTIC_2, ATTIC), (THIEF, ATTIC))), ATTIC_2) == "unknown_signer"
    # A roster naming yet another key wins.
    other = old_roster().with_rotated_key("attic", ATTIC_3.public_key, retired_at=at(20))
    assert caller(verifier(named((ATTIC_2, ATTIC)), other), ATTIC_2) == "unknown_signer"
    assert caller(verifier(named((ATTIC_2, ATTIC)), other), ATTIC_3) == "attic"


def community_settings(tmp_path: Path) -> HearthSettings:
    roster_file = tmp_path / "roster.json"
    old_roster().save(roster_file)
    return HearthSettings.model_validate({"nats": {"creds_file": str(tmp_path / "hub.nk"),
                                                   "roster_file": str(roster_file)}})


def test_the_follower_membership_and_sealing_follow_the_rotation_and_keep_it_across_a_restart(tmp_path, monkeypatch):
    import hearth.services.common.logged_steward_keys as logged_steward_keys

    log = member_log()
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    settings = community_settings(tmp_path)

    async def follow(messages) -> tuple[list, str | None, str | None]:
        monkeypatch.setattr(logged_steward_keys, "read_stream", fake_read_stream(messages))
        follower = StewardKeysFromTheLog(None, verifier, (SHARDS_STREAM,), tmp_path / "kept.json")
        await follower.start(catch_up_timeout_s=5.0)
        try:
            membership = event_trust.node_membership(settings, follower)
            sealed_to = event_trust.member_public_keys(settings, follower)
            return follower.member_keys(), membership("attic"), sealed_to("attic")
        finally:
            await follower.stop()

    expected = [(ATTIC_2.public_key, ATTIC.public_key, "attic")]
    assert asyncio.run(follow(log)) == (expected, None, ATTIC_2.public_key)
    kept_keys, membership, sealed = asyncio.run(follow([]))  # restarted after the rotation aged out of the log
    assert (sorted(set(kept_keys)), membership, sealed) == (expected, None, ATTIC_2.public_key)
    removed = [*log, stored(removal_of("attic", ATTIC_2, by=STEWARD_0, t=50), 9)]
    _, membership, sealed = asyncio.run(follow(removed))
    assert membership is not None and "removed" in membership and sealed is None

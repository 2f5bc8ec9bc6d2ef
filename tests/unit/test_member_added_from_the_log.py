"""A member's addition is followed from the log, as its removal is: the steward's signed `member.added` of garage
makes garage's key a member of that name, role and trust on that stream from there on, in a live projection (across
restarts), a rebuild, hearth-replay, and for signed calls and opens, routing's membership check and the keys an open
is sealed to, with a roster copy that does not name garage yet. Before, everything garage signed was `unknown_signer`
(its events rejected for good) until each household had a new roster copy. A forged addition teaches nothing, an
addition of a name or key the roster knows otherwise names no one, and a later removal wins."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hearth.events.logged_keys import LoggedKeys
from hearth.events.member_additions import LoggedAddition
from hearth.events.models import MemberAdded
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.readmodels.rebuild import diff_databases
from hearth.services.common import event_trust
from hearth.services.common.call_signing import CallVerifier
from hearth.services.common.config import HearthSettings
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.services.replay.verify import PassedEvents, _verdict
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER
from tests.readmodel_helpers import MODEL_ID, advertised, at, heartbeat
from tests.unit.test_applied_backfill_steward_keys import fake_read_stream
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_for_calls import caller
from tests.unit.test_steward_key_from_the_log import ATTIC, HUB, SKEW_S, STEWARD_0, old_roster, project, removal_of

GARAGE, OTHER, PHONE = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
GARAGE_SHARD = shard_id_for(MODEL_ID, 0, 3, "garage")


def addition(name: str, key: MemberKey, *, role: str = "shard", trust: str = "trusted", t: float,
             signer: MemberKey = STEWARD_0, node: str = SYSTEM_MEMBER, stream: str = SHARDS_STREAM) -> MemberAdded:
    event = MemberAdded(node_id=node, member=name, public_key=key.public_key, role=role, trust=trust, stream=stream,
                        occurred_at=at(t))
    return sign_event(event, signer)  # type: ignore[return-value]


def garage_advert(key: MemberKey, t: float):
    return sign_event(advertised(0, 3, "garage", control_subject=shard_control_subject("garage", GARAGE_SHARD), t=t),
                      key)


def garage_beat(key: MemberKey, t: float):
    return sign_event(heartbeat(GARAGE_SHARD, t=t, node="garage", tokens=int(t)), key)


def addition_log():
    events = [
        garage_advert(GARAGE, 5),                                  # 1 before its addition
        addition("garage", GARAGE, t=10),                          # 2 the steward adds garage
        garage_advert(GARAGE, 15),                                 # 3 garage's: applied
        garage_beat(GARAGE, 20),                                   # 4
        addition("garage", OTHER, t=25, signer=HUB, node="hub"),   # 5 forged: a hub is no steward
        addition("attic", OTHER, t=30),                            # 6 a name the roster knows: names no one
        sign_event(heartbeat(GARAGE_SHARD, t=35, node="garage"), OTHER),  # 7
        removal_of("garage", GARAGE, by=STEWARD_0, t=40),          # 8 a later removal wins
        garage_beat(GARAGE, 45),                                   # 9
    ]
    return [stored(event, seq) for seq, event in enumerate(events, 1)]


EXPECTED = [(1, "unknown_signer"), (5, "role_may_not_emit"), (7, "unknown_signer"), (9, "removed_signer")]


def test_a_projector_with_the_old_roster_applies_the_added_members_events_across_restarts(tmp_path):
    log = addition_log()
    rejected, _ = project(tmp_path / "live.db", old_roster(), [log[:2], log[2:5], log[5:]])
    assert rejected == EXPECTED  # 3 and 4 were unknown_signer, for good


def test_a_rebuild_equals_the_live_projection(tmp_path):
    log = addition_log()
    live, rebuilt = tmp_path / "live.db", tmp_path / "rebuilt.db"
    project(live, old_roster(), [log[:3], log[3:]])
    rejected, _ = project(rebuilt, old_roster(), [log])
    assert rejected == EXPECTED
    assert diff_databases(rebuilt, live) == []


def test_an_addition_on_another_stream_says_nothing_of_this_one():
    elsewhere = stored(addition("garage", GARAGE, t=10, stream=PIPELINES_STREAM), 1, stream=PIPELINES_STREAM)
    verifier, logged = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S), LoggedKeys()
    assert logged.rejection(verifier, elsewhere) is None
    logged.record(elsewhere.event)
    assert logged.rejection(verifier, stored(garage_beat(GARAGE, 20), 2)) == "unknown_signer"


def test_hearth_replay_verify_with_the_old_roster_follows_the_addition():
    logged, passed = LoggedKeys(), PassedEvents(None)
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    verdicts = [_verdict(verifier, message, logged, passed) for message in addition_log()]
    assert [(bad.seq, bad.reason) for bad in verdicts if bad is not None] == EXPECTED


def added(name: str, key: MemberKey, role: str = "client", trust: str = "member") -> tuple[str, LoggedAddition]:
    return key.public_key, LoggedAddition(name, role, trust, at(10))  # type: ignore[arg-type]


def test_calls_and_opens_of_an_added_member_are_its_by_the_log_alone():
    def verifier(additions, retired=()) -> CallVerifier:
        return CallVerifier(old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                            logged_retired_keys=lambda: retired, logged_member_additions=lambda signer: additions)

    assert caller(verifier([]), PHONE) == "unknown_signer"  # as before: the roster alone
    assert caller(verifier([added("phone", PHONE)]), PHONE) == "phone"
    # Its role is the addition's, as the roster's would be: a shard host calls nothing.
    assert caller(CallVerifier(old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                               caller_roles=("client", "system"),
                               logged_member_additions=lambda signer: [added("phone", PHONE, role="shard")]),
                  PHONE) == "role_may_not_call"
    assert caller(verifier([added("phone", PHONE)], retired=[PHONE.public_key]), PHONE) == "unknown_signer"
    # Two streams adding the key as different members, or the member under two keys: neither counts.
    assert caller(verifier([added("phone", PHONE), added("tablet", PHONE)]), PHONE) == "unknown_signer"
    assert caller(verifier([added("phone", PHONE), added("phone", OTHER)]), PHONE) == "unknown_signer"
    # A name the roster gives another key names no one.
    assert caller(verifier([added("attic", PHONE)]), PHONE) == "unknown_signer"
    assert caller(verifier([added("phone", ATTIC)]), ATTIC) == "attic"  # the roster's word stands


def community_settings(tmp_path: Path) -> HearthSettings:
    roster_file = tmp_path / "roster.json"
    old_roster().save(roster_file)
    return HearthSettings.model_validate({"nats": {"creds_file": str(tmp_path / "hub.nk"),
                                                   "roster_file": str(roster_file)}})


def test_the_follower_membership_and_sealing_follow_the_addition_and_keep_it_across_a_restart(tmp_path, monkeypatch):
    import hearth.services.common.logged_steward_keys as logged_steward_keys

    log = addition_log()
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    settings = community_settings(tmp_path)

    async def follow(messages) -> tuple[str | None, str | None, str | None]:
        monkeypatch.setattr(logged_steward_keys, "read_stream", fake_read_stream(messages))
        follower = StewardKeysFromTheLog(None, verifier, (SHARDS_STREAM,), tmp_path / "kept.json")
        await follower.start(catch_up_timeout_s=5.0)
        try:
            calls = event_trust.call_verifier(settings, follower)
            membership = event_trust.node_membership(settings, follower)
            sealed_to = event_trust.member_public_keys(settings, follower)
            return caller(calls, GARAGE), membership("garage"), sealed_to("garage")
        finally:
            await follower.stop()

    # A shard host calls nothing, but its key is garage's: role_may_not_call, no longer unknown_signer.
    assert asyncio.run(follow(log[:4])) == ("role_may_not_call", None, GARAGE.public_key)
    assert asyncio.run(follow([])) == ("role_may_not_call", None, GARAGE.public_key)  # kept: aged out of the log
    refused, membership, sealed = asyncio.run(follow(log))  # a later removal wins
    assert refused == "unknown_signer" and membership is not None and "removed" in membership and sealed is None


def test_an_add_with_no_broker_named_tries_the_configured_one_briefly(tmp_path, monkeypatch):
    """A steward adding its first members usually runs no broker yet: with no --nats, `add` tries the configured
    broker for a short while (not [nats] connect_timeout_s, 10 s, for every member) and says the roster alone holds
    the addition."""
    from typer.testing import CliRunner

    from hearth.services.cli import app
    from tests.unit.test_community_removal import unused_port

    monkeypatch.setenv("HEARTH_NATS_URL", f"nats://127.0.0.1:{unused_port()}")  # nothing listens there
    community = tmp_path / "community"
    assert CliRunner().invoke(app, ["community", "init", "--dir", str(community), "--name", "hub"]).exit_code == 0
    added = CliRunner().invoke(app, ["community", "add", "--dir", str(community), "--name", "alice",
                                     "--role", "client"])
    assert added.exit_code == 0, added.output
    assert "the addition was not published" in added.output and "within 2 s" in added.output, added.output

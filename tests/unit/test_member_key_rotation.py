"""`hearth community rotate-key`: a member's key replaced in place (its name, node and record kept), the old key
retired at a position in each stream, so that what it signed before still verifies and nothing it signs after does
(events, calls, sealed hop keys, the gateway's API keys), and `hearth community list` shows the retired keys; and what
an operator could do before it (remove the member and add it again) cost the member its name."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
from datetime import datetime, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from hearth.events.consume import StoredEvent
from hearth.events.models import MemberKeyRotated, decode_event, encode_event
from hearth.events.signing import EventVerifier, StreamPosition, sign_event
from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS, SHARDS_STREAM
from hearth.protocol.subjects import event_subject, shard_control_subject, shard_id_for
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.rebuild import diff_databases
from hearth.readmodels.tables import RejectedEvent
from hearth.services.broker.permissions import render_authorization
from hearth.services.cli import app
from hearth.services.common.call_signing import CallVerifier, signed_call_headers
from hearth.services.common.identity import IdentityError, load_identity
from hearth.services.community_removal import publish_removal, rotation_events
from hearth.services.gateway.keys import ApiKeyError, ApiKeyring, create_api_key
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey, sealed_to
from hearth.trust.roster import RemovalCut, Roster, RosterError
from tests.readmodel_helpers import MODEL_ID, advertised, at, heartbeat, migrated_engine
from tests.unit.test_community_removal import FakeBroker, steward_publishes_to

SHARD_ID = shard_id_for(MODEL_ID, 0, 3, "attic")


def run(*args: str):
    return CliRunner().invoke(app, ["community", *args])


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "c", "elm-street")
    community.add("attic", "shard")
    community.add("alice", "client")
    return community


def test_without_a_rotation_a_member_removed_for_a_leaked_key_cannot_come_back_under_its_name(community):
    assert run("remove", "--name", "attic", "--offline", "--dir", str(community.directory)).exit_code == 0
    again = run("add", "--name", "attic", "--role", "shard", "--dir", str(community.directory))
    assert again.exit_code == 1 and "choose another name" in again.output


def test_rotate_key_offline_writes_a_new_private_seed_retires_the_old_key_and_deletes_its_seed(community):
    old = community.roster().by_name("attic")
    old_seed = community.directory / "keys" / "attic.nk"
    result = run("rotate-key", "attic", "--offline", "--dir", str(community.directory))
    assert result.exit_code == 0, result.output
    roster = community.roster()
    attic = roster.by_name("attic")
    new_key = MemberKey.load(old_seed)  # the new seed, where the old one was, mode 0600
    assert stat.S_IMODE(old_seed.stat().st_mode) == 0o600
    assert attic.public_key == new_key.public_key != old.public_key
    assert (attic.role, attic.trust, attic.added_at) == (old.role, old.trust, old.added_at)
    assert [retired.public_key for retired in attic.retired_keys] == [old.public_key]
    assert f"its new seed: {old_seed}" in result.output
    # The new seed took the old one's path: "the old key's seed at <that path> is deleted" read as the new one gone.
    assert "it replaced the old key's seed there" in result.output and "is deleted" not in result.output
    # Other machines' roster copies must name the new key, or they reject it (`unknown_signer`), as a walk found.
    assert "hand the new roster.json (" in " ".join(result.output.split())
    assert "no rotation event published (--offline)" in result.output
    assert list((community.directory / "keys").glob("attic.nk.*")) == []  # nothing left beside it
    authorization = render_authorization(roster)
    assert new_key.public_key in authorization and old.public_key not in authorization
    assert roster.by_key(old.public_key) is None and roster.former_keys()[old.public_key].member.name == "attic"


@pytest.mark.parametrize(("args", "says"), [
    (["nobody"], "no member named 'nobody'"),
    (["system", "--public-key", MemberKey.generate().public_key], "run it without --public-key"),
    (["attic", "--public-key", "UNOTAKEY"], "not a NATS user public key"),
    (["gone"], "'gone' was removed from the community"),
])
def test_bad_input_is_one_line_and_changes_nothing(community, args, says):
    community.add("gone", "client")
    community.remove("gone")
    before = community.roster_path.read_bytes()
    result = run("rotate-key", *args, "--offline", "--dir", str(community.directory))
    assert result.exit_code == 1 and says in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert community.roster_path.read_bytes() == before


def test_a_key_once_held_never_comes_back(community):
    old = community.roster().by_name("attic").public_key
    community.rotate_key("attic", MemberKey.generate())
    with pytest.raises(RosterError, match="retired"):
        community.rotate_key("attic", old)
    with pytest.raises(RosterError, match="retired"):
        community.add("newcomer", "client", public_key=old)
    document = json.loads(community.roster_path.read_text())
    document["members"][1]["retired_keys"].append(document["members"][1]["retired_keys"][0])
    community.roster_path.write_text(json.dumps(document))
    with pytest.raises(RosterError, match="retired key is held again"):
        community.roster()


def test_rosters_of_older_versions_load_and_one_without_rotations_is_written_as_before(community):
    document = json.loads(community.roster_path.read_text())
    # An older hearth (one from before key rotation and removals) refuses any key it does not know, so a roster
    # that uses neither writes only the keys it reads.
    assert set(document) == {"format", "community", "created_at", "members"}
    assert all("retired_keys" not in member for member in document["members"])
    community.rotate_key("attic", MemberKey.generate())
    assert Roster.load(community.roster_path).by_name("attic").retired_keys


def test_a_roster_of_a_newer_format_is_refused_in_one_line_naming_both_formats(community):
    document = json.loads(community.roster_path.read_text())
    community.roster_path.write_text(json.dumps({**document, "format": 2, "groups": []}))
    with pytest.raises(RosterError) as refused:
        Roster.load(community.roster_path)
    assert str(refused.value) == (f"{community.roster_path} is a roster of format 2, newer than this hearth reads "
                                  f"(format 1): upgrade it")


def test_the_member_bringing_its_own_key_and_a_failed_write_leave_things_as_they_were(community, monkeypatch):
    seed = community.directory / "keys" / "attic.nk"
    old_seed = seed.read_bytes()

    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Roster, "save", full_disk)
    with pytest.raises(OSError):
        community.rotate_key("attic", MemberKey.generate())
    assert seed.read_bytes() == old_seed and sorted(p.name for p in seed.parent.iterdir()) == [
        "alice.nk", "attic.nk", "system.nk"]
    monkeypatch.undo()
    own = MemberKey.generate()
    rotated = community.rotate_key("attic", own.public_key)
    assert rotated.seed_file is None and rotated.old_seed_deleted == seed and not seed.exists()
    assert community.roster().by_name("attic").public_key == own.public_key


def test_the_rotation_goes_on_every_stream_naming_both_keys_and_the_roster_keeps_where(community):
    broker = FakeBroker()
    attic = community.roster().by_name("attic")
    new_key = MemberKey.generate()
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    published = asyncio.run(publish_removal(attic, community.system_key(), broker, verifier,
                                            make_event=rotation_events(new_key.public_key)))
    assert [cut.stream for cut in published.cuts] == list(ALL_STREAMS)
    for stream, seq, _subject, event in broker.stored:
        assert isinstance(decode_event(encode_event(event)), MemberKeyRotated)
        assert (event.member, event.public_key, event.new_public_key) == ("attic", attic.public_key,
                                                                          new_key.public_key)
        assert verifier.rejection(event, received_at=event.occurred_at, position=StreamPosition(stream, seq)) is None
    # A rerun finds them and publishes nothing more.
    again = asyncio.run(publish_removal(attic, community.system_key(), broker, verifier,
                                        make_event=rotation_events(MemberKey.generate().public_key)))
    assert again.cuts == published.cuts and len(broker.stored) == len(ALL_STREAMS)
    rotated = community.rotate_key("attic", new_key, cuts=published.cuts)
    assert rotated.retired.cuts == published.cuts


def stored(event, seq: int) -> StoredEvent:
    subject = MEMBER_REMOVAL_SUBJECTS[event.stream] if isinstance(event, MemberKeyRotated) else event_subject(event)
    return StoredEvent(stream=SHARDS_STREAM, seq=seq, subject=subject, time=event.occurred_at, headers={},
                       event=event, data=encode_event(event))


def project(path, roster: Roster | object, batches) -> list[tuple[int, str]]:
    engine = migrated_engine(path)
    try:
        for batch in batches:
            with Session(engine) as session, session.begin():
                ReadModelProjection(verifier=EventVerifier(roster, max_clock_skew_s=30)).apply_many(session, batch)
        with Session(engine) as session:
            return [(row.stream_seq, row.reason) for row in
                    session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq))]
    finally:
        engine.dispose()


def test_old_key_events_before_the_rotation_apply_after_it_are_refused_live_and_in_a_rebuild(community, tmp_path):
    roster_before = community.roster()
    old_key = MemberKey.load(community.directory / "keys" / "attic.nk")
    new_key = MemberKey.generate()
    advert = advertised(0, 3, "attic", control_subject=shard_control_subject("attic", SHARD_ID), t=0)
    events = [sign_event(event, old_key) for event in (advert, heartbeat(SHARD_ID, t=10, node="attic"))]
    rotation = MemberKeyRotated(node_id="system", member="attic", public_key=old_key.public_key,
                                new_public_key=new_key.public_key, stream=SHARDS_STREAM, occurred_at=at(20))
    events.append(sign_event(rotation, community.system_key()))
    events += [sign_event(heartbeat(SHARD_ID, t=30, node="attic"), old_key),  # the leaked key, after: refused
               sign_event(heartbeat(SHARD_ID, t=40, node="attic"), new_key)]  # the member's new key: applied
    log = [stored(event, seq) for seq, event in enumerate(events, 1)]
    # Live: the projector reads the rotation before the steward saved the roster (the new key not in it yet).
    live = tmp_path / "live.db"
    assert project(live, roster_before, [log[:3], log[3:4]]) == [(4, "removed_signer")]
    cut = RemovalCut(stream=SHARDS_STREAM, seq=3, event_id=rotation.event_id)
    community.rotate_key("attic", new_key, cuts=[cut], retired_at=at(25))
    rebuilt = tmp_path / "rebuilt.db"
    assert project(rebuilt, community.roster(), [log]) == [(4, "removed_signer")]
    assert project(live, community.roster(), [log[4:]]) == [(4, "removed_signer")]
    assert diff_databases(rebuilt, live) == []


def test_after_the_rotation_calls_sealed_hop_keys_the_gateway_and_a_process_refuse_the_old_key(community, tmp_path):
    old_key = MemberKey.load(community.directory / "keys" / "alice.nk")
    create_api_key(community.directory, "alice")
    copy = tmp_path / "gateway-copy"  # a gateway's folder that kept the old seed
    shutil.copytree(community.directory, copy)
    new_key = MemberKey.generate()
    community.rotate_key("alice", new_key)
    shutil.copy(community.roster_path, copy / "roster.json")
    verifier = CallVerifier(community.roster(), max_clock_skew_s=30, min_caller_trust="member")
    call = ("llm.chat.request", "_INBOX.alice.x", b"{}")
    assert verifier.check(*call, signed_call_headers(old_key, *call, now_s=1e9), now_s=1e9).reason == "unknown_signer"
    assert verifier.check(*call, signed_call_headers(new_key, *call, now_s=1e9), now_s=1e9).name == "alice"
    sealed = sealed_to(community.roster().by_name("alice").public_key, b"hop keys")
    assert old_key.unseal(sealed) is None and new_key.unseal(sealed) == b"hop keys"
    [(_, caller)] = ApiKeyring.load(community.directory)._entries
    assert caller.key.public_key == new_key.public_key
    with pytest.raises(ApiKeyError, match="is not the key the roster has for alice"):
        ApiKeyring.load(copy)
    with pytest.raises(IdentityError, match="'alice' retired at .*use the new seed"):
        load_identity(copy / "keys" / "alice.nk", community.roster_path)


def test_hearth_replay_verify_passes_the_old_keys_events_before_the_rotation_only(community):
    from hearth.events.logged_keys import LoggedKeys
    from hearth.services.replay.verify import PassedEvents, _verdict

    old_key = MemberKey.load(community.directory / "keys" / "attic.nk")
    advert = advertised(0, 3, "attic", control_subject=shard_control_subject("attic", SHARD_ID), t=0)
    rotation = MemberKeyRotated(node_id="system", member="attic", public_key=old_key.public_key,
                                new_public_key=MemberKey.generate().public_key, stream=SHARDS_STREAM,
                                occurred_at=at(20))
    events = [sign_event(advert, old_key), sign_event(rotation, community.system_key()),
              sign_event(heartbeat(SHARD_ID, t=30, node="attic"), old_key)]
    community.rotate_key("attic", rotation.new_public_key,
                         cuts=[RemovalCut(stream=SHARDS_STREAM, seq=2, event_id=rotation.event_id)])
    verifier, removals = EventVerifier(community.roster(), max_clock_skew_s=30), LoggedKeys()
    passed = PassedEvents(None)
    verdicts = [_verdict(verifier, stored(event, seq), removals, passed) for seq, event in enumerate(events, 1)]
    assert [None if bad is None else bad.reason for bad in verdicts] == [None, None, "removed_signer"]


def test_rotate_key_publishes_first_and_says_where_the_old_key_was_retired(community, monkeypatch):
    broker = steward_publishes_to(FakeBroker(), monkeypatch)
    old = community.roster().by_name("attic").public_key
    result = run("rotate-key", "attic", "--dir", str(community.directory), "--nats", "nats://hub:4222")
    assert result.exit_code == 0, result.output
    [retired] = community.roster().by_name("attic").retired_keys
    # attic was added before the log: each stream gets its addition first, then the rotation.
    assert [(event.type, stream) for stream, *_, event in broker.stored] == [
        (kind, stream) for stream in ALL_STREAMS for kind in ("member.added", "member.key_rotated")]
    assert retired.public_key == old and [(cut.stream, cut.seq) for cut in retired.cuts] == [
        (stream, seq) for stream, seq, *_, event in broker.stored if event.type == "member.key_rotated"]
    assert "(at HEARTH_SHARDS #41, HEARTH_PIPELINES #43)" in result.output
    said = " ".join(result.output.split())  # other machines follow the log; the member's own needs the roster
    assert "accept attic's new key from the rotation in the event log" in said and "still recommended" in said
    assert "Give attic's machine its new seed with the new roster.json" in said
    assert {getattr(event, "new_public_key", None) for *_, event in broker.stored} == {
        None, community.roster().by_name("attic").public_key}


def listed(community: Community) -> list[str]:
    result = CliRunner().invoke(app, ["community", "list", "--dir", str(community.directory),
                                      "--db", str(community.directory / "no-readmodel.sqlite")])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_list_shows_each_retired_key_with_its_member_time_and_place(community):
    """`hearth community list` shows the keys that no longer count without a look into roster.json."""
    old_attic = community.roster().by_name("attic").public_key
    retired_at = datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc)
    cut = RemovalCut(stream="HEARTH_SHARDS", seq=812, event_id="e1", stored_at=retired_at)
    community.rotate_key("attic", MemberKey.generate(), cuts=[cut], retired_at=retired_at)
    old_alice = community.roster().by_name("alice").public_key
    community.rotate_key("alice", MemberKey.generate())
    community.remove("alice")  # a removed member's retired keys are still retired keys

    lines = listed(community)
    [attic_row] = [line for line in lines if old_attic in line]
    assert attic_row.split()[:3] == ["attic", "shard", "retired"]
    assert "at 2026-03-01 12:30:00 UTC, HEARTH_SHARDS #812" in attic_row
    [alice_row] = [line for line in lines if old_alice in line]
    assert alice_row.split()[:3] == ["alice", "client", "retired"]
    current = community.roster().by_name("attic").public_key
    assert [line.split()[2] for line in lines if current in line] == ["trusted"]  # its current key, a member's row


def test_a_roster_without_rotations_lists_no_retired_rows(community):
    assert not any(" retired " in line for line in listed(community))


def test_add_offline_says_to_hand_the_roster_out(community):
    """With no addition in the log, a machine whose roster copy lacks the new member rejects its events, calls and
    opens (`unknown_signer`)."""
    result = run("add", "--name", "bob", "--role", "shard", "--offline", "--dir", str(community.directory))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "to every member's machine" in said and "hand the new roster.json (" in said and "unknown_signer" in said

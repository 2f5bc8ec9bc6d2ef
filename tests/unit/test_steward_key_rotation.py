"""`hearth community rotate-key system`: the steward's own key replaced in place. The old key signs the
`member.key_rotated` naming the new one on each stream (so the log chains the two), then the roster holds the new key
and retires the old one there; `DIR/keys/system.nk` holds the new seed and the old seed is gone. Before, the
steward's key could not be rotated at all: replacing it meant a new community folder."""

from __future__ import annotations

from datetime import timedelta

import pytest
from typer.testing import CliRunner

from hearth.events.models import IntegrityQuarantineCleared, MemberKeyRotated, MemberRemoved
from hearth.events.signing import EventVerifier, StreamPosition, sign_event
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM
from hearth.protocol.subjects import event_subject
from hearth.services.cli import app
from hearth.services.common.identity import IdentityError, load_identity
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER, RemovalCut
from tests.unit.test_community_removal import FakeBroker, steward_publishes_to


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "c", "elm-street")
    community.add("attic", "shard")
    return community


@pytest.fixture
def broker(monkeypatch) -> FakeBroker:
    """The streams `hearth community rotate-key --nats` publishes on."""
    return steward_publishes_to(FakeBroker(), monkeypatch)


def run(*args: str):
    return CliRunner().invoke(app, ["community", *args])


def test_the_old_steward_key_signs_its_rotation_and_the_folder_then_holds_only_the_new_one(community, broker,
                                                                                           tmp_path):
    old_key = community.system_key()
    old_copy = tmp_path / "old-system.nk"  # what a leaked copy would be
    old_copy.write_bytes(old_key.seed)
    old_copy.chmod(0o600)
    result = run("rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--nats", "nats://hub:4222")
    assert result.exit_code == 0, result.output

    roster = community.roster()
    new_key = community.system_key()
    assert roster.by_name(SYSTEM_MEMBER).public_key == new_key.public_key != old_key.public_key
    assert (community.system_key_path.stat().st_mode & 0o777) == 0o600
    assert sorted(path.name for path in (community.directory / "keys").iterdir()) == ["attic.nk", "system.nk"]
    [retired] = roster.by_name(SYSTEM_MEMBER).retired_keys
    assert retired.public_key == old_key.public_key
    assert [(cut.stream, cut.seq) for cut in retired.cuts] == [(stream, seq) for stream, seq, *_ in broker.stored]
    for *_, event in broker.stored:  # the chain: the old key names its successor
        assert isinstance(event, MemberKeyRotated)
        assert (event.signer, event.public_key, event.new_public_key) == (old_key.public_key, old_key.public_key,
                                                                          new_key.public_key)
    # The steward's tooling on other machines needs the new folder; a cluster's routes follow the key.
    assert "restart every node" in result.output and "roster" in result.output
    assert "delete it here" not in result.output  # the folder must keep the steward's seed
    with pytest.raises(IdentityError, match="'system' retired at"):
        load_identity(old_copy, community.roster_path)


def test_a_verifier_follows_the_chain_from_the_old_steward_key_to_the_new(community, broker):
    old_key = community.system_key()
    assert run("rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--nats", "nats://hub:4222"
               ).exit_code == 0
    new_key = community.system_key()
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    stream, seq, subject, rotation = broker.stored[-1]
    assert stream == PIPELINES_STREAM
    stored_at = rotation.occurred_at + timedelta(seconds=1)
    assert verifier.rejection(rotation, received_at=stored_at, position=StreamPosition(stream, seq, subject)) is None

    def verdict(event, key: MemberKey, later_by: int):
        signed = sign_event(event.model_copy(update={"occurred_at": rotation.occurred_at}), key)
        return verifier.rejection(signed, received_at=stored_at, position=StreamPosition(
            stream, seq + later_by, event_subject(signed) if not isinstance(signed, MemberRemoved)
            else MEMBER_REMOVAL_SUBJECTS[stream]))

    cleared = IntegrityQuarantineCleared(pipeline_id="clear-1", node_id=SYSTEM_MEMBER, shard_id="m:0-1@attic",
                                         reason="checked")
    assert verdict(cleared, old_key, 1) == "removed_signer"  # the retired steward key, after its rotation
    assert verdict(cleared, new_key, 2) is None
    removal = MemberRemoved(node_id=SYSTEM_MEMBER, member="attic",
                            public_key=community.roster().by_name("attic").public_key, stream=stream)
    assert verdict(removal, new_key, 3) is None  # the new steward key removes members


def test_the_stewards_key_is_made_here_never_brought(community):
    before = (community.roster_path.read_bytes(), community.system_key_path.read_bytes())
    result = run("rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--offline",
                 "--public-key", MemberKey.generate().public_key)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "without --public-key" in result.output
    assert (community.roster_path.read_bytes(), community.system_key_path.read_bytes()) == before


def test_offline_the_steward_rotation_changes_the_folder_alone_and_says_so(community):
    old_key = community.system_key()
    result = run("rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--offline")
    assert result.exit_code == 0, result.output
    assert "no rotation event published (--offline)" in result.output
    assert community.system_key().public_key == community.roster().by_name(SYSTEM_MEMBER).public_key
    assert community.roster().retired_key_of(old_key.public_key)[0].name == SYSTEM_MEMBER


def test_the_stewards_rotation_at_its_own_cut_passes_whatever_the_microsecond_its_time_reads(community):
    """The cut keeps the storage time as the broker's stored message says it (get_msg), a reader sees it in the
    delivery's metadata; the two were seen a microsecond apart, and the rotation, signed by the key it retires, was
    then `removed_signer` on that stream."""
    old_key, new_key = community.system_key(), MemberKey.generate()
    rotation = sign_event(MemberKeyRotated(node_id=SYSTEM_MEMBER, member=SYSTEM_MEMBER, public_key=old_key.public_key,
                                           new_public_key=new_key.public_key, stream=PIPELINES_STREAM), old_key)
    stored_at = rotation.occurred_at + timedelta(seconds=1)
    cut = RemovalCut(stream=PIPELINES_STREAM, seq=1, event_id=rotation.event_id,
                     stored_at=stored_at - timedelta(microseconds=1))
    community.rotate_key(SYSTEM_MEMBER, new_key, cuts=[cut], retired_at=stored_at)
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    subject = MEMBER_REMOVAL_SUBJECTS[PIPELINES_STREAM]
    assert verifier.rejection(rotation, received_at=stored_at,
                              position=StreamPosition(PIPELINES_STREAM, 1, subject)) is None
    # Another event of the old key at that place (the stream made again since) is still after the cut.
    other = sign_event(rotation.model_copy(update={"event_id": "another"}), old_key)
    assert verifier.rejection(other, received_at=stored_at,
                              position=StreamPosition(PIPELINES_STREAM, 1, subject)) == "removed_signer"

"""Removing a member (hearth/trust/roster.py, hearth/trust/community.py, `hearth community remove`): it leaves the
members but stays on record, its key can never come back, the steward's key cannot be removed, and the broker's
authorization no longer names it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hearth.services.broker.permissions import render_authorization
from hearth.services.cli import app
from hearth.services.common.identity import IdentityError, load_identity
from hearth.services.gateway.keys import ApiKeyring, create_api_key
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER, Roster, RosterError


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "community", "test")
    community.add("alice", "client")
    community.add("kitchen", "shard")
    return community


def test_a_removed_member_leaves_the_members_and_the_broker_but_stays_on_record(community):
    alice = community.roster().by_name("alice")
    removed, seed_file = community.remove("alice")
    roster = community.roster()
    assert removed.member == alice and seed_file == community.directory / "keys" / "alice.nk"
    assert not seed_file.exists()
    assert roster.by_name("alice") is None and roster.by_key(alice.public_key) is None
    assert roster.removed_by_key(alice.public_key).removed_at == removed.removed_at
    assert alice.public_key not in render_authorization(roster)
    assert roster.by_name("kitchen").public_key in render_authorization(roster)


def test_neither_a_removed_key_nor_a_removed_name_joins_again(community):
    alice = community.roster().by_name("alice")
    community.remove("alice")
    with pytest.raises(RosterError, match="removed at .* needs a new key"):
        community.add("alice-again", "client", public_key=alice.public_key)
    # The name's node, shards and record are the removed member's: nobody new inherits them.
    with pytest.raises(RosterError, match="'alice' was a member removed at .* choose another name"):
        community.add("alice", "client")
    assert community.add("alice2", "client").member.public_key != alice.public_key
    # A roster file edited by hand to let the key or the name back in does not read.
    for field, value, refusal in (("public_key", alice.public_key, "key of a removed member"),
                                  ("name", "alice", "name of a removed member")):
        document = json.loads(community.roster_path.read_text())
        edited = json.loads(community.roster_path.read_text())
        edited["members"][-1][field] = value
        community.roster_path.write_text(json.dumps(edited))
        with pytest.raises(RosterError, match=refusal):
            community.roster()
        community.roster_path.write_text(json.dumps(document))


def test_a_removal_time_without_a_time_zone_does_not_read(community):
    community.remove("alice")
    document = json.loads(community.roster_path.read_text())
    document["removed"][0]["removed_at"] = "2026-12-05T00:00:00"
    community.roster_path.write_text(json.dumps(document))
    with pytest.raises(RosterError, match="timezone"):
        community.roster()


def test_the_stewards_key_and_members_not_in_the_roster_cannot_be_removed(community):
    with pytest.raises(RosterError, match="steward's system key"):
        community.remove(SYSTEM_MEMBER)
    with pytest.raises(RosterError, match="no member named 'bob'"):
        community.remove("bob")
    community.remove("alice")
    with pytest.raises(RosterError, match="no member named 'alice'"):
        community.remove("alice")
    assert community.roster().by_name(SYSTEM_MEMBER) is not None


def test_a_roster_written_before_removals_existed_still_reads(community):
    document = json.loads(community.roster_path.read_text())
    assert "removed" not in document  # nobody removed: written as before, so an older hearth reads it too
    assert Roster.model_validate_json(json.dumps(document)).removed == []


def test_hearth_community_remove_says_what_it_did_and_refuses_in_one_line(community):
    directory = str(community.directory)
    create_api_key(community.directory, "alice")
    create_api_key(community.directory, "alice")
    kept = create_api_key(community.directory, "system")
    result = CliRunner().invoke(app, ["community", "remove", "--name", "alice", "--dir", directory, "--offline"])
    assert result.exit_code == 0, result.output
    assert "removed alice (client, member)" in result.output and "revoked its 2 API keys" in result.output
    keyring = ApiKeyring.load(community.directory)
    assert keyring.members == ["system"] and keyring.caller_for(kept) is not None
    result = CliRunner().invoke(app, ["community", "remove", "--name", "kitchen", "--dir", directory, "--offline"])
    assert result.exit_code == 0, result.output
    assert "removed kitchen (shard, trusted)" in result.output and "deleted" in result.output
    refused = CliRunner().invoke(app, ["community", "remove", "--name", "kitchen", "--dir", directory, "--offline"])
    assert refused.exit_code == 1 and "no member named 'kitchen'" in refused.output
    # A refusal changes nothing: the API keys of a member that cannot be removed stay.
    create_api_key(community.directory, "system")
    refused = CliRunner().invoke(app, ["community", "remove", "--name", "system", "--dir", directory, "--offline"])
    assert refused.exit_code == 1 and len(ApiKeyring.load(community.directory)) == 2
    assert "Traceback" not in refused.output
    listed = CliRunner().invoke(app, ["community", "list", "--dir", directory])
    current, removed = listed.output.split("\nalice ", 1)
    assert "kitchen" not in current and "system" in current
    assert removed.split()[:3] == ["client", "removed", community.roster().removed[0].member.public_key]



def test_a_process_started_with_a_removed_members_key_says_so_in_one_line(community, tmp_path):
    kept_key = tmp_path / "kitchen.nk"
    kept_key.write_text((community.directory / "keys" / "kitchen.nk").read_text())
    kept_key.chmod(0o600)
    assert load_identity(kept_key, community.roster_path).name == "kitchen"
    community.remove("kitchen")
    with pytest.raises(IdentityError, match="belonged to 'kitchen', removed from the community at .* new name and key"):
        load_identity(kept_key, community.roster_path)


@pytest.mark.parametrize("where", ["member", "retired"])
def test_a_roster_key_with_a_bad_checksum_is_refused_where_it_is_read(community, where):
    """A member's key and a retired key are held to the same check (the pattern, then the checksum)."""
    community.rotate_key("kitchen", MemberKey.generate())
    document = json.loads(community.roster_path.read_text())
    kitchen = next(member for member in document["members"] if member["name"] == "kitchen")
    held = kitchen if where == "member" else kitchen["retired_keys"][0]
    held["public_key"] = held["public_key"][:-1] + ("A" if held["public_key"][-1] != "A" else "B")
    community.roster_path.write_text(json.dumps(document))
    with pytest.raises(RosterError, match="public_key: Value error, not a NATS user public key"):
        community.roster()

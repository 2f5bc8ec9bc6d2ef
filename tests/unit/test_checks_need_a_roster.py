"""A process that logs in with a member key is on a community mesh, so what it checks against the roster (signed
calls, events, opens, who may serve) must never be silently skipped because no roster was found beside its key:
it refuses to start instead (hearth/services/common/event_trust.py, hearth/services/cli_options.py)."""

from __future__ import annotations

import pytest
import typer

from hearth.services.cli_options import node_id_for
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import call_verifier, event_verifier, node_membership, open_verifier
from hearth.services.common.identity import IdentityError, load_identity
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey

CHECKS = (call_verifier, event_verifier, node_membership, open_verifier)


def _settings(creds_file, roster_file=None) -> HearthSettings:
    nats = {"creds_file": str(creds_file)} | ({"roster_file": str(roster_file)} if roster_file else {})
    return HearthSettings.model_validate({"nats": nats})


@pytest.fixture
def lone_key(tmp_path):
    """A member's key handed over alone, as `hearth community add` says to ("give it to bob"): no roster beside it."""
    community = Community.init(tmp_path / "community", "checks")
    added = community.add("bob", "orchestrator")
    lone = tmp_path / "home" / "bob.nk"
    MemberKey.load(added.seed_file).save(lone)
    return community, lone


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_a_member_key_without_a_roster_is_refused_not_left_unchecked(lone_key, check):
    with pytest.raises(IdentityError, match="roster_file"):
        check(_settings(lone_key[1]))


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_the_same_key_with_its_roster_is_checked(lone_key, check):
    community, lone = lone_key
    assert check(_settings(lone, community.roster_path)) is not None


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_an_open_mesh_still_checks_nothing(check):
    assert check(HearthSettings()) is None


@pytest.mark.parametrize("role", ["orchestrator", "shard", "projector"])
def test_a_role_s_process_with_a_key_no_roster_names_is_refused(lone_key, role):
    """Without a roster neither the key's role nor its name can be checked: `hearth shard --creds` with a client's
    key would otherwise start under any node id."""
    identity = load_identity(lone_key[1])
    assert identity.member is None
    with pytest.raises(typer.Exit):
        node_id_for(f"hearth {role}", identity, None, role)


def test_hearth_replay_says_so_in_one_line(lone_key, tmp_path, monkeypatch):
    """A rebuild with the key alone would apply what the live projectors reject; it ends with one line instead."""
    from typer.testing import CliRunner

    from hearth.services.replay.cli import app

    monkeypatch.setenv("HEARTH_NATS__CREDS_FILE", str(lone_key[1]))
    for arguments in (["rebuild", "--db", str(tmp_path / "rebuilt.sqlite")], ["verify"]):
        result = CliRunner().invoke(app, arguments)
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert "no community roster for the key" in result.output


@pytest.mark.parametrize(("holder", "role", "wanted", "needed"), [
    ("audit", "auditor", "projector", "a projector"), ("alice", "client", "shard", "a shard"),
    ("kitchen-pc", "shard", "orchestrator", "an orchestrator")])
def test_a_key_of_another_role_is_refused_saying_which_member_the_process_needs(tmp_path, capsys, holder, role,
                                                                                wanted, needed):
    """An operator following the README's community setup starts `hearth projector --creds` with some member's key:
    the refusal names the role it needs and the command that adds such a member, in readable words."""
    community = Community.init(tmp_path / "community", "roles")
    identity = load_identity(community.add(holder, role).seed_file)
    with pytest.raises(typer.Exit):
        node_id_for(f"hearth {wanted}", identity, None, wanted)
    said = capsys.readouterr().err
    article = "an" if role[0] in "aeiou" else "a"
    assert f"the key belongs to {holder}, {article} {role}, not {needed}: {needed} logs in with {needed} member's" \
        in said
    assert f"hearth community add --name NAME --role {wanted}" in said

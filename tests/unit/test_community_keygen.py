"""`hearth community keygen`: a member makes its key on its own machine (the seed stays there, mode 0600) and hands
the steward only the public key it prints, for `hearth community add --public-key`; the key then logs in and signs
as that member once the roster is copied beside it."""

from __future__ import annotations

import shutil
import stat

from typer.testing import CliRunner

from hearth.services.community_cli import community_app
from hearth.services.common.identity import load_identity
from hearth.trust.community import Community
from hearth.trust.roster import seed_path


def test_a_key_made_on_the_members_machine_joins_through_add_public_key(tmp_path):
    attic = tmp_path / "attic-pc" / "community"
    made = CliRunner().invoke(community_app, ["keygen", "--name", "attic-pc", "--dir", str(attic)])
    assert made.exit_code == 0, made.output
    seed_file = seed_path(attic, "attic-pc")
    assert stat.S_IMODE(seed_file.stat().st_mode) == 0o600 and stat.S_IMODE(attic.stat().st_mode) == 0o700
    public_key = made.stdout.strip()
    assert public_key.startswith("U")
    # Only the public key: never the seed (an "SU..." word; a public key may hold the letters "SU" anywhere).
    seed = seed_file.read_text().strip()
    assert seed.startswith("SU") and seed not in made.output
    assert not any(word.startswith("SU") for word in made.output.split())

    steward = Community.init(tmp_path / "hub" / "community", "elm-street")
    added = CliRunner().invoke(community_app, ["add", "--name", "attic-pc", "--role", "shard",
                                               "--public-key", public_key, "--offline", "--dir",
                                               str(steward.directory)])
    assert added.exit_code == 0, added.output
    shutil.copy(steward.roster_path, attic / "roster.json")  # the steward hands the roster over
    assert load_identity(seed_file).member.name == "attic-pc"


def test_it_never_replaces_a_key_and_refuses_a_name_no_member_may_have(tmp_path):
    folder = tmp_path / "community"
    assert CliRunner().invoke(community_app, ["keygen", "--name", "attic-pc", "--dir", str(folder)]).exit_code == 0
    seed = seed_path(folder, "attic-pc").read_bytes()
    for name in ("attic-pc", "no spaces"):
        again = CliRunner().invoke(community_app, ["keygen", "--name", name, "--dir", str(folder)])
        assert again.exit_code == 1 and len(again.output.strip().splitlines()) == 1, again.output
    assert seed_path(folder, "attic-pc").read_bytes() == seed
    assert not seed_path(folder, "no spaces").exists()

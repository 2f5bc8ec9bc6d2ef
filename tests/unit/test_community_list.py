"""`hearth community list`: the members, the members removed and every key retired by a rotation (whose it was,
when and where it was retired, the key itself), so a steward sees which keys no longer count without reading
roster.json."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.roster import RemovalCut


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "c", "elm-street")
    community.add("attic", "shard")
    community.add("alice", "client")
    return community


def listed(community: Community) -> list[str]:
    result = CliRunner().invoke(app, ["community", "list", "--dir", str(community.directory),
                                      "--db", str(community.directory / "no-readmodel.sqlite")])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_list_shows_each_retired_key_with_its_member_time_and_place(community):
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

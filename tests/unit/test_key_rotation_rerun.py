"""`hearth community rotate-key` run again after its events were published but its roster was not saved: the
roster ends up holding the key the log's rotation names (the new seed kept pending beside the roster until then),
a pending seed never outlives the rotation nor serves another member, and a log naming a key whose seed is not
here is refused before anything more is published."""

from __future__ import annotations

import stat

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.pending_rotation import keep_pending_seed, pending_seed_path
from hearth.trust.roster import Roster
from tests.unit.test_community_removal import FakeBroker, steward_publishes_to
from tests.unit.test_member_key_rotation import community  # noqa: F401 (a fixture: attic, a shard, and alice)


@pytest.fixture
def broker(monkeypatch) -> FakeBroker:
    return steward_publishes_to(FakeBroker(), monkeypatch)


def rotate(community: Community, name: str, *args: str):
    return CliRunner().invoke(app, ["community", "rotate-key", name, "--dir", str(community.directory),
                                    "--nats", "nats://hub:4222", *args])


def rotate_with_a_full_disk(community: Community, name: str):
    """A run whose events go out but whose roster is not saved."""

    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Roster, "save", full_disk)
        return rotate(community, name)


def rotations(broker: FakeBroker) -> list:
    """The rotations the broker holds (the fixture's members were added before the log: each stream gets a member's
    addition before its first rotation)."""
    return [event for *_, event in broker.stored if event.type == "member.key_rotated"]


def named_in_the_log(broker: FakeBroker) -> set[str]:
    return {event.new_public_key for event in rotations(broker)}


def test_a_rerun_after_the_roster_save_failed_holds_the_key_the_log_names(community, broker):
    first = rotate_with_a_full_disk(community, "attic")
    assert first.exit_code == 1 and "run it again" in first.output
    [named] = named_in_the_log(broker)
    pending = pending_seed_path(community.directory, "attic")
    assert stat.S_IMODE(pending.stat().st_mode) == 0o600
    again = rotate(community, "attic")
    assert again.exit_code == 0, again.output
    assert community.roster().by_name("attic").public_key == named
    assert MemberKey.load(community.directory / "keys" / "attic.nk").public_key == named
    assert named_in_the_log(broker) == {named} and "published by an earlier run" in again.output
    assert not pending.exists()  # the rotation is finished: its seed is keys/attic.nk alone


def test_a_pending_seed_of_a_finished_rotation_or_another_member_is_not_used(community, broker):
    attic = community.roster().by_name("attic")
    stale = MemberKey.generate()
    keep_pending_seed(community.directory, attic, stale)
    community.rotate_key("attic", MemberKey.generate())  # a rotation that finished after it was kept
    assert not pending_seed_path(community.directory, "attic").exists()
    # Killed after the roster was saved, before it was deleted: it replaces a key the member no longer holds.
    keep_pending_seed(community.directory, attic, stale)
    alice = community.roster().by_name("alice")
    pending_seed_path(community.directory, "attic").rename(pending_seed_path(community.directory, "alice"))
    assert rotate(community, "alice").exit_code == 0
    keep_pending_seed(community.directory, attic, stale)
    assert rotate(community, "attic").exit_code == 0
    assert stale.public_key not in named_in_the_log(broker)
    assert stale.public_key not in {member.public_key for member in community.roster().members}
    assert community.roster().by_name("alice").public_key != alice.public_key
    assert list((community.directory / "keys").glob("*.pending*")) == []


def test_a_log_naming_a_key_whose_seed_is_not_here_is_refused_before_publishing_more(community, broker):
    broker.refusing = ("HEARTH_PIPELINES",)
    assert rotate_with_a_full_disk(community, "attic").exit_code == 1
    [named] = named_in_the_log(broker)
    broker.refusing = ()
    pending_seed_path(community.directory, "attic").unlink()  # lost (or kept by an older hearth, which made none)
    before = community.roster_path.read_bytes()
    refused = rotate(community, "attic")
    assert refused.exit_code == 1 and f"--public-key {named}" in refused.output
    assert len(broker.stored) == 2 and community.roster_path.read_bytes() == before
    other = rotate(community, "attic", "--public-key", MemberKey.generate().public_key)
    assert other.exit_code == 1 and len(broker.stored) == 2 and community.roster_path.read_bytes() == before
    brought = rotate(community, "attic", "--public-key", named)
    assert brought.exit_code == 0, brought.output
    assert community.roster().by_name("attic").public_key == named and named_in_the_log(broker) == {named}
    assert len(rotations(broker)) == 2  # the stream that had refused it now holds the same rotation


def test_removing_the_member_deletes_its_pending_seed(community):
    keep_pending_seed(community.directory, community.roster().by_name("attic"), MemberKey.generate())
    community.remove("attic")
    assert not pending_seed_path(community.directory, "attic").exists()


def test_a_key_brought_while_a_generated_one_is_pending_is_refused(community, broker):
    assert rotate_with_a_full_disk(community, "attic").exit_code == 1
    before = community.roster_path.read_bytes()
    brought = rotate(community, "attic", "--public-key", MemberKey.generate().public_key)
    assert brought.exit_code == 1 and "run it again without --public-key" in brought.output
    assert community.roster_path.read_bytes() == before and len(rotations(broker)) == 2
    assert pending_seed_path(community.directory, "attic").exists()  # the seed the log names is kept

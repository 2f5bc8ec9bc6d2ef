"""The steward's key rotations a process learned, kept in a file: they read back as written (0600, replaced whole),
and count again only where they chain back to the roster's steward key, each signed by the key it retires. A file
that does not read, or rotations that do not chain, are left out with one WARNING line; a roster that names a later
steward key wins."""

from __future__ import annotations

import logging
import stat

from hearth.events.signing import EventVerifier
from hearth.events.steward_keys import caller_by_logs
from hearth.services.common.kept_steward_keys import (
    KeptRemoval, load_kept_removals, read_kept_removals, trusted_removals, write_kept_removals,
)
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER
from tests.readmodel_helpers import at
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_from_the_log import (
    HUB, SKEW_S, STEWARD_0, STEWARD_1, STEWARD_2, THIEF, old_roster, rotation,
)

LOG = "hearth.services.common.kept_steward_keys"


def kept(*rotations) -> list[KeptRemoval]:
    """Each rotation as its stream stored it, at seq 3, 10, ... in order."""
    return [KeptRemoval.of(stored(event, seq)) for seq, event in zip((3, 10, 17, 24), rotations, strict=False)]


def named_of(logged) -> set[tuple[str, str]]:
    return {(key, succeeded) for (_, key), succeeded in logged.steward_keys.items()}


def test_kept_rotations_read_back_as_written_privately(tmp_path):
    path = tmp_path / "state" / "steward-keys.json"
    rotations = kept(rotation(STEWARD_0, STEWARD_1, t=20), rotation(STEWARD_1, STEWARD_2, t=50))
    write_kept_removals(path, reversed(rotations))
    assert read_kept_removals(path) == rotations
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_kept_removals(path, rotations[:1])  # replaced whole
    assert read_kept_removals(path) == rotations[:1]
    assert [p.name for p in path.parent.iterdir()] == ["steward-keys.json"]  # no temporary file left behind
    assert read_kept_removals(tmp_path / "none.json") == []


def test_a_chain_from_the_rosters_steward_key_counts_for_calls():
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    rotations = kept(rotation(STEWARD_0, STEWARD_1, t=20), rotation(STEWARD_1, STEWARD_2, t=50))
    logged, trusted = trusted_removals(verifier, rotations)
    assert trusted == rotations
    named = named_of(logged)
    assert named == {(STEWARD_1.public_key, STEWARD_0.public_key), (STEWARD_2.public_key, STEWARD_1.public_key)}
    assert caller_by_logs(old_roster(), STEWARD_2.public_key, named).name == SYSTEM_MEMBER
    assert caller_by_logs(old_roster(), STEWARD_0.public_key, named) is None


def test_rotations_that_do_not_chain_back_to_the_rosters_steward_key_are_left_out_with_one_warning(tmp_path, caplog):
    path = tmp_path / "steward-keys.json"
    write_kept_removals(path, kept(
        rotation(STEWARD_1, STEWARD_2, t=50),                            # its predecessor's rotation is missing
        rotation(STEWARD_0, THIEF, signer=HUB, node="hub", t=21),        # signed by a key that is not the steward's
        rotation(THIEF, MemberKey.generate(), t=30)))                    # a key no chain reaches
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    with caplog.at_level(logging.INFO, logger=LOG):
        logged, trusted = load_kept_removals(path, verifier)
    assert (named_of(logged), trusted) == (set(), [])
    assert [(r.levelname, "3 of 3 removals do not verify" in r.getMessage()) for r in caplog.records] == [
        ("WARNING", True)]


def test_a_file_that_does_not_read_is_left_out_with_one_warning(tmp_path, caplog):
    path = tmp_path / "steward-keys.json"
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    for content in (b"{not json", b'{"version": 1, "rotations": [{"stream": "SHARDS"}]}', b"x" * 3_000_000):
        path.write_bytes(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOG):
            logged, trusted = load_kept_removals(path, verifier)
        assert (named_of(logged), trusted) == (set(), [])
        assert [r.levelname for r in caplog.records] == ["WARNING"] and "do not read" in caplog.records[0].getMessage()


def test_a_body_that_is_not_a_removal_teaches_nothing(tmp_path):
    forged = KeptRemoval.of(stored(rotation(STEWARD_0, STEWARD_1, t=20), 3)).model_copy(update={"body": "bm90"})
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    assert trusted_removals(verifier, [forged])[1] == []


def test_a_roster_that_names_a_later_steward_key_wins(tmp_path, caplog):
    """The roster handed out after the rotation names STEWARD_1 itself: the kept rotation it retired is left out,
    quietly (the roster caught up), and the chain for calls starts at the roster's key."""
    path = tmp_path / "steward-keys.json"
    rotations = kept(rotation(STEWARD_0, STEWARD_1, t=20))
    write_kept_removals(path, rotations)
    newer = old_roster().with_rotated_key(SYSTEM_MEMBER, STEWARD_1.public_key, retired_at=at(10), cuts=[])
    with caplog.at_level(logging.WARNING, logger=LOG):
        logged, _ = load_kept_removals(path, EventVerifier(newer, max_clock_skew_s=SKEW_S))
    assert caplog.records == []
    named = named_of(logged) | {(STEWARD_1.public_key, STEWARD_0.public_key)}  # even if a stream still names it
    assert caller_by_logs(newer, STEWARD_1.public_key, named).name == SYSTEM_MEMBER
    assert caller_by_logs(newer, STEWARD_0.public_key, named) is None

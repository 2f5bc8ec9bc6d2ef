"""Every verified removal and key rotation a process learned from the event streams is kept in its state folder's
file, so a process started after it left the streams (shards keep 7 days) still refuses the key it retired, whatever
its old roster copy says. Before, only the steward's rotations were kept: a removed member's key was accepted again.
The file is trusted no further than the log: each entry is verified again, in stream order, by the steward key chain;
one that does not verify is left out with one WARNING line; version 1 of the file still reads."""

from __future__ import annotations

import asyncio
import json
import logging

from hearth.events.signing import EventVerifier
from hearth.services.common import kept_steward_keys
from hearth.services.common import logged_steward_keys
from hearth.services.common.call_signing import CallVerifier
from hearth.services.common.kept_steward_keys import (
    KeptRemoval, load_kept_removals, read_kept_removals, within_bounds, write_kept_removals,
)
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.events.streams import SHARDS_STREAM
from tests.unit.test_applied_backfill_steward_keys import fake_read_stream
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_for_calls import caller
from tests.unit.test_steward_key_from_the_log import (
    ATTIC, HUB, SKEW_S, STEWARD_0, STEWARD_1, STEWARD_2, THIEF, old_roster, removal_of, rotation, steward_log,
)

LOG = "hearth.services.common.kept_steward_keys"


def kept(*events) -> list[KeptRemoval]:
    return [KeptRemoval.of(stored(event, seq)) for seq, event in enumerate(events, 1)]


def verifier() -> EventVerifier:
    return EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)


def retired_by(logged) -> set[str]:
    return {key for _, key in logged.removed}


def test_removals_and_rotations_read_back_as_written(tmp_path):
    path = tmp_path / "steward-keys.json"
    removals = kept(rotation(STEWARD_0, STEWARD_1, t=20), removal_of("attic", ATTIC, by=STEWARD_1, t=30),
                    rotation(HUB, THIEF, member="hub", signer=STEWARD_1, t=35))
    assert write_kept_removals(path, reversed(removals)) == removals
    assert read_kept_removals(path) == removals
    assert json.loads(path.read_text())["version"] == 2
    logged, trusted = load_kept_removals(path, verifier())
    assert trusted == removals
    assert retired_by(logged) == {STEWARD_0.public_key, ATTIC.public_key, HUB.public_key}


def test_entries_not_signed_by_the_steward_key_chain_are_left_out_with_one_warning(tmp_path, caplog):
    path = tmp_path / "steward-keys.json"
    genuine = kept(rotation(STEWARD_0, STEWARD_1, t=20), removal_of("attic", ATTIC, by=STEWARD_1, t=30))
    forged = [KeptRemoval.of(stored(event, seq)) for seq, event in (
        (5, removal_of("hub", HUB, by=HUB, t=40)),            # signed by a key that is not the steward's
        (6, removal_of("hub", HUB, by=THIEF, t=41)),          # signed by a key no chain reaches
        (7, removal_of("hub", HUB, by=STEWARD_0, t=42)))]     # signed by the steward key the log retired before
    tampered = genuine[1].model_copy(update={"seq": 8, "body": genuine[1].body.replace("attic", "attix", 1)})
    write_kept_removals(path, [*genuine, *forged, tampered])
    with caplog.at_level(logging.INFO, logger=LOG):
        logged, trusted = load_kept_removals(path, verifier())
    assert trusted == genuine
    assert HUB.public_key not in retired_by(logged)
    assert [(r.levelname, "4 of 6 removals do not verify" in r.getMessage()) for r in caplog.records] == [
        ("WARNING", True)]


def test_a_version_1_file_still_reads(tmp_path):
    path = tmp_path / "steward-keys.json"
    rotations = kept(rotation(STEWARD_0, STEWARD_1, t=20), rotation(STEWARD_1, STEWARD_2, t=50))
    path.write_text(json.dumps({"version": 1, "rotations": [json.loads(r.model_dump_json()) for r in rotations]}))
    logged, trusted = load_kept_removals(path, verifier())
    assert trusted == rotations
    assert set(logged.steward_keys.values()) == {STEWARD_0.public_key, STEWARD_1.public_key}


def test_past_its_bounds_the_file_leaves_out_the_oldest_removals_first(monkeypatch, caplog):
    monkeypatch.setattr(kept_steward_keys, "max_kept_removals", 2)
    removals = kept(rotation(STEWARD_0, STEWARD_1, t=20), removal_of("attic", ATTIC, by=STEWARD_1, t=30),
                    removal_of("hub", HUB, by=STEWARD_1, t=40))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert within_bounds(removals) == [removals[0], removals[2]]  # the steward's rotation verifies the rest
    assert len(caplog.records) == 1


def follow_once(monkeypatch, log, kept_file) -> StewardKeysFromTheLog:
    monkeypatch.setattr(logged_steward_keys, "read_stream", fake_read_stream(log))
    follower = StewardKeysFromTheLog(None, verifier(), (SHARDS_STREAM,), kept_file)

    async def run() -> None:
        await follower.start(catch_up_timeout_s=5.0)
        await follower.stop()

    asyncio.run(run())
    return follower


def test_a_process_started_after_the_removal_left_the_stream_still_refuses_the_removed_key(monkeypatch, tmp_path):
    kept_file = tmp_path / "state" / "steward-keys.json"
    before = follow_once(monkeypatch, steward_log(), kept_file)
    assert {ATTIC.public_key, HUB.public_key} <= before.retired_keys()

    after = follow_once(monkeypatch, [], kept_file)  # the stream aged them out; the roster copy is the old one
    assert after.retired_keys() == before.retired_keys()
    assert sorted(after.named()) == sorted(before.named())
    opens = CallVerifier(old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                         logged_steward_keys=after.named, logged_retired_keys=after.retired_keys)
    assert caller(opens, ATTIC) == caller(opens, HUB) == "unknown_signer"

    forgetful = follow_once(monkeypatch, [], None)  # as before: the old roster copy alone accepts it
    opens = CallVerifier(old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                         logged_steward_keys=forgetful.named, logged_retired_keys=forgetful.retired_keys)
    assert caller(opens, ATTIC) == "attic"

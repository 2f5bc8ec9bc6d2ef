"""Signed calls and opens follow the steward keys the event streams' logs name, as events do: once a log shows the
steward's rotation of its own key, the retired key's calls and opens are refused and the new key's accepted, with a
roster that still names the old one. Before, both went by the roster alone: the retired (perhaps leaked) steward key
still called and opened as the steward until each household had a new roster copy, and the new one could not."""

from __future__ import annotations

import asyncio

from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.events.signing import EventVerifier, sign_event
from hearth.services.common.call_signing import CallRefused, CallVerifier, signed_call_headers
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER, RemovalCut
from tests.readmodel_helpers import at
from tests.unit.test_applied_backfill_steward_keys import fake_read_stream
from tests.unit.test_member_removal_cut import stored
from tests.unit.test_steward_key_from_the_log import (HUB, SKEW_S, STEWARD_0, STEWARD_1, STEWARD_2, THIEF, old_roster,
                                                      rotation, steward_log)

NOW_S = 1e9
CALL = ("llm.chat.request", "_INBOX.system.x", b"{}")


def caller(verifier: CallVerifier, key: MemberKey) -> str:
    """The member name the call signed by `key` is accepted as, or the refusal's reason."""
    checked = verifier.check(*CALL, signed_call_headers(key, *CALL, now_s=NOW_S), now_s=NOW_S)
    return checked.reason if isinstance(checked, CallRefused) else checked.name


def verifier_with(named: list[tuple[MemberKey, MemberKey]], roster=None) -> CallVerifier:
    pairs = [(new.public_key, old.public_key) for new, old in named]
    return CallVerifier(roster or old_roster(), max_clock_skew_s=SKEW_S, min_caller_trust="member",
                        logged_steward_keys=lambda: pairs)


def test_the_retired_steward_key_is_refused_and_the_new_one_is_the_steward():
    verifier = verifier_with([(STEWARD_1, STEWARD_0)])
    assert caller(verifier, STEWARD_0) == "unknown_signer"
    assert caller(verifier, STEWARD_1) == SYSTEM_MEMBER
    checked = verifier.check(*CALL, signed_call_headers(STEWARD_1, *CALL, now_s=NOW_S), now_s=NOW_S)
    assert checked.trust == "steward" and checked.role == "system"


def test_a_chain_of_rotations_leaves_only_its_last_key():
    verifier = verifier_with([(STEWARD_1, STEWARD_0), (STEWARD_2, STEWARD_1)])
    assert [caller(verifier, key) for key in (STEWARD_0, STEWARD_1, STEWARD_2)] == [
        "unknown_signer", "unknown_signer", SYSTEM_MEMBER]


def test_streams_naming_different_successors_leave_no_steward_key_until_a_roster_settles_it():
    """A leaked old key that got its own rotation into one stream first: neither successor calls as the steward."""
    verifier = verifier_with([(STEWARD_1, STEWARD_0), (THIEF, STEWARD_0)])
    assert [caller(verifier, key) for key in (STEWARD_0, STEWARD_1, THIEF)] == ["unknown_signer"] * 3
    cut = RemovalCut(stream=SHARDS_STREAM, seq=1, event_id="e-rotation")
    settled = old_roster().with_rotated_key(SYSTEM_MEMBER, STEWARD_1.public_key, retired_at=at(20), cuts=[cut])
    verifier = verifier_with([(STEWARD_1, STEWARD_0), (THIEF, STEWARD_0)], settled)
    assert [caller(verifier, key) for key in (STEWARD_0, STEWARD_1, THIEF)] == [
        "unknown_signer", SYSTEM_MEMBER, "unknown_signer"]


def test_a_log_never_makes_another_members_key_the_stewards():
    verifier = verifier_with([(HUB, STEWARD_0)])
    checked = verifier.check(*CALL, signed_call_headers(HUB, *CALL, now_s=NOW_S), now_s=NOW_S)
    assert checked.name == "hub" and checked.role == "orchestrator"
    assert caller(verifier, STEWARD_0) == "unknown_signer"


def test_without_a_rotation_in_the_logs_the_roster_decides():
    verifier = verifier_with([])
    assert caller(verifier, STEWARD_0) == SYSTEM_MEMBER
    assert caller(verifier, STEWARD_1) == "unknown_signer"


def test_the_follower_names_only_what_the_trusted_steward_key_passed_on_in_each_stream(monkeypatch):
    """The removals subjects of each stream, read as a projection reads them: forged, retired and thieves' rotations
    (in steward_log) name nothing; a stream of its own shows its own rotation."""
    import hearth.services.common.logged_steward_keys as logged_steward_keys

    pipelines_rotation = sign_event(rotation(STEWARD_0, STEWARD_1, t=20).model_copy(
        update={"stream": PIPELINES_STREAM}), STEWARD_0)
    log = [*steward_log(), stored(pipelines_rotation, 1, stream=PIPELINES_STREAM)]
    monkeypatch.setattr(logged_steward_keys, "read_stream", fake_read_stream(log))
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    follower = StewardKeysFromTheLog(None, verifier, (SHARDS_STREAM, PIPELINES_STREAM))
    told: list[str] = []  # what a shard host drops at once (hearth/services/shard/hop_closing.py)
    follower.retirement_listeners.append(lambda removal: told.append(removal.public_key))

    async def run() -> list[tuple[str, str]]:
        await follower.start(catch_up_timeout_s=5.0)
        try:
            return sorted(follower.named())
        finally:
            await follower.stop()

    named = asyncio.run(run())
    assert len(told) == len(set(told)) and set(told) == follower.retired_keys()  # each retired key told once
    assert named == sorted([(STEWARD_1.public_key, STEWARD_0.public_key)] * 2 + [
        (STEWARD_2.public_key, STEWARD_1.public_key)])

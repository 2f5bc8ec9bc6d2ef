"""Signed calls: what the orchestrator's CallVerifier accepts and refuses, each for its own reason; each signing
header bounded to its exact form before any other work."""

from __future__ import annotations

from datetime import datetime, timezone

from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import call_verifier, open_verifier
from hearth.services.common.call_signing import (
    HEADER_CALLER,
    HEADER_CALLER_NONCE,
    HEADER_CALLER_SIGNATURE,
    HEADER_CALLER_TIME,
    CallRefused,
    CallVerifier,
    nonce_bytes,
    signed_call_headers,
)
from hearth.services.transport.headers import header_bytes
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member

SUBJECT, REPLY, BODY = "llm.chat.request", "_INBOX.alice.abc", b'{"prompt": "hi"}'
NOW_S = 1_800_000_000.0


def community():
    alice, bob, stranger = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    roster = roster.with_member(new_member("alice", "client", alice.public_key, "trusted"))
    roster = roster.with_member(new_member("bob", "client", bob.public_key, "member"))
    verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")
    return verifier, alice, bob, stranger


def reason(result) -> str:
    return result.reason if isinstance(result, CallRefused) else f"accepted {result.name}"


def test_a_signed_call_is_accepted_once_and_a_replay_is_refused():
    verifier, alice, _, _ = community()
    headers = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S)
    assert reason(verifier.check(SUBJECT, REPLY, BODY, headers, now_s=NOW_S + 1)) == "accepted alice"
    assert reason(verifier.check(SUBJECT, REPLY, BODY, headers, now_s=NOW_S + 2)) == "replayed"


def test_each_bad_call_is_refused_for_its_reason():
    verifier, alice, _, stranger = community()
    good = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S)
    assert reason(verifier.check(SUBJECT, REPLY, BODY, None, now_s=NOW_S)) == "unsigned"
    foreign = signed_call_headers(stranger, SUBJECT, REPLY, BODY, now_s=NOW_S)
    assert reason(verifier.check(SUBJECT, REPLY, BODY, foreign, now_s=NOW_S)) == "unknown_signer"
    # Another body, another reply inbox (the answer redirected), another timestamp: the signature no longer fits.
    assert reason(verifier.check(SUBJECT, REPLY, b'{"prompt": "bye"}', good, now_s=NOW_S)) == "bad_signature"
    assert reason(verifier.check(SUBJECT, "_INBOX.eve.x", BODY, good, now_s=NOW_S)) == "bad_signature"
    assert reason(verifier.check(SUBJECT, REPLY, BODY, {**good, HEADER_CALLER_TIME: f"{NOW_S + 5:.3f}"},
                                 now_s=NOW_S)) == "bad_signature"
    stale = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S - 60)
    assert reason(verifier.check(SUBJECT, REPLY, BODY, stale, now_s=NOW_S)) == "stale"


def test_min_caller_trust_refuses_members_below_it():
    verifier, alice, bob, _ = community()
    verifier.min_caller_trust = "trusted"
    assert reason(verifier.check(SUBJECT, REPLY, BODY, signed_call_headers(bob, SUBJECT, REPLY, BODY, now_s=NOW_S),
                                 now_s=NOW_S)) == "untrusted"
    trusted = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S)
    assert reason(verifier.check(SUBJECT, REPLY, BODY, trusted, now_s=NOW_S)) == "accepted alice"


def test_signing_headers_must_have_their_exact_form_before_anything_is_checked():
    verifier, alice, _, _ = community()
    good = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S)
    forms = {
        HEADER_CALLER: ["U" + "A" * 1_000_000, "alice"],
        HEADER_CALLER_TIME: ["nan", "inf", "-1800000000", "1.8e9", "1_800_000_000", "1" * 13, " 1800000000"],
        HEADER_CALLER_NONCE: ["ab" * 500_000, "z" * 32, "ab" * 15],
        HEADER_CALLER_SIGNATURE: ["A" * 1_000_000, good[HEADER_CALLER_SIGNATURE][:-4]],
    }
    for name, values in forms.items():
        for value in values:
            assert reason(verifier.check(SUBJECT, REPLY, BODY, {**good, name: value}, now_s=NOW_S)) == "malformed"
    assert not verifier._seen  # nothing refused was remembered
    assert reason(verifier.check(SUBJECT, REPLY, BODY, good, now_s=NOW_S)) == "accepted alice"


def test_a_non_finite_timestamp_is_refused_and_so_is_its_replay():
    verifier, alice, _, _ = community()
    # A caller signing `nan` as its time: the signature fits, but the time is no time at all.
    nan_headers = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=float("nan"))
    assert nan_headers[HEADER_CALLER_TIME] == "nan"
    for later_s in (NOW_S, NOW_S + 3600, NOW_S + 86_400 * 365):
        assert reason(verifier.check(SUBJECT, REPLY, BODY, nan_headers, now_s=later_s)) == "malformed"


def test_the_nonce_cache_holds_only_nonces_of_their_exact_size():
    verifier, alice, _, _ = community()
    for offset in range(3):
        headers = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S + offset)
        assert reason(verifier.check(SUBJECT, REPLY, BODY, headers, now_s=NOW_S + offset)) == "accepted alice"
    assert [len(nonce) for nonce in verifier._seen] == [2 * nonce_bytes] * 3


def test_the_role_behind_a_reply_inbox_is_looked_up_only_for_a_member_s_name():
    verifier, _, _, _ = community()
    assert verifier.role_of("alice") == "client"
    assert verifier.role_of("nobody") is None and verifier.role_of("a" * 1_000_000) is None


def test_request_header_bytes_counts_names_and_values():
    assert header_bytes(None) == 0
    assert header_bytes({"Ab": "cde", HEADER_CALLER_NONCE: "x" * 1000}) == 5 + len(HEADER_CALLER_NONCE) + 1000



def test_only_members_whose_role_may_call_are_answered(tmp_path):
    """A shard host, orchestrator, projector or auditor key may sign a call (the gateway signs with the key of any
    member an API key names); the broker keeps their own connections off the call subjects, so their signature on a
    call means their key is used where it should not be. Refused, however trusted the member; opens are not calls."""
    community = Community.init(tmp_path / "community", "t")
    keys = {"system": community.system_key()}
    for role in ("client", "shard", "orchestrator", "projector", "auditor"):
        keys[role] = MemberKey.load(community.add(f"a-{role}", role, trust="steward").seed_file)
    names = {"system": "system"} | {role: f"a-{role}" for role in keys if role != "system"}
    settings = HearthSettings.model_validate({"nats": {"creds_file": str(community.system_key_path)}})
    calls, opens = call_verifier(settings), open_verifier(settings)
    for role, key in keys.items():
        headers = signed_call_headers(key, SUBJECT, REPLY, BODY, now_s=NOW_S)
        expected = f"accepted {names[role]}" if role in ("client", "system") else "role_may_not_call"
        assert reason(calls.check(SUBJECT, REPLY, BODY, headers, now_s=NOW_S)) == expected, role
        assert reason(opens.check(SUBJECT, REPLY, BODY, headers, now_s=NOW_S)) == f"accepted {names[role]}"


def test_a_key_the_log_retired_signs_no_call_whatever_the_roster_copy_says():
    _, alice, bob, _ = community()
    retired: set[str] = set()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    for name, key in (("alice", alice), ("bob", bob)):
        roster = roster.with_member(new_member(name, "client", key.public_key, "trusted"))
    verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member",
                            logged_retired_keys=lambda: retired)
    call = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S)
    assert reason(verifier.check(SUBJECT, REPLY, BODY, call, now_s=NOW_S)) == "accepted alice"
    retired.add(alice.public_key)  # the removal read from the log, the roster copy unchanged
    refused = verifier.check(SUBJECT, REPLY, BODY, signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S),
                             now_s=NOW_S)
    assert reason(refused) == "unknown_signer" and "removed" in refused.message
    bob_call = signed_call_headers(bob, SUBJECT, "_INBOX.bob.x", BODY, now_s=NOW_S)
    assert reason(verifier.check(SUBJECT, "_INBOX.bob.x", BODY, bob_call, now_s=NOW_S)) == "accepted bob"

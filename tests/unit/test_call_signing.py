"""Signed calls: what the orchestrator's CallVerifier accepts and refuses, each for its own reason."""

from __future__ import annotations

from datetime import datetime, timezone

from services.common.call_signing import HEADER_CALLER_TIME, CallRefused, CallVerifier, signed_call_headers
from trust.keys import MemberKey
from trust.roster import Roster, new_member

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

"""A starting shard's verdict on its id: it keeps it unless a process serves it or a rival's claim is lower; on a
community mesh a rival is a process that signs its claim with the node's own key."""

from __future__ import annotations

from types import SimpleNamespace

from hearth.protocol.control import ControlReply, ShardStat, StatShard
from hearth.services.shard.claim import ShardClaim
from hearth.trust.keys import MemberKey


def answer(claim: str | None) -> bytes:
    return ShardStat(shard_id="m:0-1@n", active_streams=0, cached_sessions=0, cache_bytes=0,
                     claim=claim).model_dump_json().encode()


def claim_with(nonce: str) -> ShardClaim:
    claim = ShardClaim()
    claim.nonce = nonce
    return claim


def test_alone_it_keeps_its_id_and_then_answers_as_serving():
    claim = claim_with("5" * 32)
    assert claim.answer_claim() == "5" * 32
    assert claim.decide() is True
    assert claim.answer_claim() is None


def test_a_process_answering_without_a_claim_serves_the_id():
    claim = claim_with("0" * 32)
    claim.hear_answer(answer(None))
    assert claim.decide() is False


def test_an_answer_that_is_no_shard_stat_comes_from_a_process_serving_the_id():
    # A shard that knows no claims refuses the field, and so still proves it serves.
    claim = claim_with("0" * 32)
    claim.hear_answer(ControlReply(ok=False, code="bad_request", message="claim: extra").model_dump_json().encode())
    assert claim.decide() is False


def test_of_two_starting_at_once_only_the_lower_claim_keeps_the_id_whichever_way_each_heard_the_other():
    low, high = claim_with("1" * 32), claim_with("e" * 32)
    low.hear_claim(high.nonce)  # high's question reached low ...
    high.hear_answer(answer(low.answer_claim()))  # ... and low's answer reached high
    assert (low.decide(), high.decide()) == (True, False)
    low, high = claim_with("1" * 32), claim_with("e" * 32)
    high.hear_claim(low.nonce)
    low.hear_answer(answer(high.answer_claim()))
    assert (low.decide(), high.decide()) == (True, False)


def test_its_own_claim_heard_back_is_no_rival():
    claim = claim_with("9" * 32)
    claim.hear_claim(claim.nonce)
    claim.hear_answer(answer(claim.nonce))
    assert claim.decide() is True


def test_a_claim_heard_once_decided_changes_nothing():
    claim = claim_with("9" * 32)
    assert claim.decide() is True
    claim.hear_claim("0" * 32)
    assert claim.kept is True and claim.answer_claim() is None


def claim_message(subject: str, reply: str, body: bytes, headers: dict[str, str] | None) -> SimpleNamespace:
    return SimpleNamespace(subject=subject, reply=reply, data=body, headers=headers)


def test_on_a_community_mesh_only_a_claim_signed_with_the_node_s_key_is_a_rival_s():
    node_key, other_key = MemberKey.generate(), MemberKey.generate()
    ours, rival = ShardClaim(node_key), ShardClaim(node_key)
    subject, inbox = "hearth.ctl.n.abc", "_INBOX.n.x"
    body = StatShard(claim=rival.nonce).model_dump_json().encode()
    assert ours.from_this_node(claim_message(subject, inbox, body, rival.headers(subject, inbox, body)))
    # Unsigned (an orchestrator may publish on the control subject), another member's, or moved elsewhere: no rival.
    assert not ours.from_this_node(claim_message(subject, inbox, body, None))
    assert not ours.from_this_node(claim_message(subject, inbox, body, ShardClaim(other_key).headers(
        subject, inbox, body)))
    assert not ours.from_this_node(claim_message(subject, "_INBOX.n.y", body, rival.headers(subject, inbox, body)))
    lower = StatShard(claim="0" * 32).model_dump_json().encode()
    assert not ours.from_this_node(claim_message(subject, inbox, lower, rival.headers(subject, inbox, body)))


def test_on_an_open_mesh_claims_go_unsigned_and_every_one_is_heard():
    claim = ShardClaim()
    assert claim.headers("hearth.ctl.n.abc", "_INBOX.x", b"{}") is None
    assert claim.from_this_node(claim_message("hearth.ctl.n.abc", "_INBOX.x", b"{}", None))

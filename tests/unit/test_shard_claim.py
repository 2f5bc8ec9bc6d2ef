"""A starting shard's verdict on its id: it keeps it unless a process serves it or a rival's claim is lower."""

from __future__ import annotations

from hearth.protocol.control import ControlReply, ShardStat
from hearth.services.shard.claim import ShardClaim


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

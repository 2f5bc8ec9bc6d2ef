"""A shard process's verdict on its id: it gives way, then or later, to every claim it hears (asked, or in an answer to
its own) that ranks before its own, so exactly one keeps it whatever the delays; on a community mesh a rival is a
process that signs its claim with the node's own key."""

from __future__ import annotations

import asyncio
import heapq
import random
from types import SimpleNamespace

import pytest

from hearth.protocol.control import ControlReply, ShardStat, StatShard
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.shard.claim import ShardClaim, unless_taken
from hearth.trust.keys import MemberKey


def answer_from(claim: ShardClaim) -> bytes:
    """What `claim`'s process answers another's claim."""
    return ShardStat(shard_id="m:0-1@n", active_streams=0, cached_sessions=0, cache_bytes=0,
                     **claim.answer_fields()).model_dump_json().encode()


def claim_at(at_ns: int, nonce: str | None = None) -> ShardClaim:
    claim = ShardClaim(clock_ns=lambda: at_ns)
    claim.nonce = nonce or claim.nonce
    return claim


def test_alone_it_keeps_its_id():
    claim = claim_at(100)
    assert claim.decide() is True and not claim.lost.is_set()


def test_a_claim_made_later_is_answered_and_its_process_gives_way_on_the_answer_even_once_it_serves():
    serving, newcomer = claim_at(100, "f" * 32), claim_at(200, "0" * 32)  # a lower nonce does not outrank the time
    assert serving.decide() is True
    assert serving.hear_claim(newcomer.question()) is True
    late = answer_from(serving)
    assert newcomer.decide() is True  # the answer came after its deadline: it kept the id at first ...
    newcomer.hear_answer(late)
    assert newcomer.kept is False and newcomer.lost.is_set()  # ... and gives way once it comes
    assert serving.kept is True and not serving.lost.is_set()


def test_a_claim_that_outranks_its_own_makes_a_process_give_way_silently_whether_deciding_or_serving():
    early = claim_at(100)
    deciding = claim_at(200)
    assert deciding.hear_claim(early.question()) is False  # not answered
    assert deciding.decide() is False and deciding.lost.is_set()
    serving = claim_at(300)
    assert serving.decide() is True
    assert serving.hear_claim(early.question()) is False
    assert serving.kept is False and serving.lost.is_set()


def test_claims_made_at_the_same_time_are_ranked_by_nonce():
    low, high = claim_at(100, "1" * 32), claim_at(100, "e" * 32)
    assert low.hear_claim(high.question()) is True
    assert high.hear_claim(low.question()) is False
    assert (low.decide(), high.decide()) == (True, False)


def test_an_answer_without_a_rank_comes_from_a_shard_from_before_ranks_that_serves_the_id():
    for old_answer in (ShardStat(shard_id="m:0-1@n", active_streams=0, cached_sessions=0, cache_bytes=0),
                       ControlReply(ok=False, code="bad_request", message="claimed_at_ns: extra")):
        claim = claim_at(100)
        claim.hear_answer(old_answer.model_dump_json().encode())
        assert claim.decide() is False


def test_a_claim_from_a_shard_from_before_ranks_ranks_last_and_is_answered_as_served():
    serving = claim_at(100)
    assert serving.decide() is True
    assert serving.hear_claim(StatShard(claim="0" * 32)) is True
    assert "claim" not in serving.answer_fields()  # such a shard refuses on an answer with no claim


def test_its_own_claim_heard_back_changes_nothing():
    claim = claim_at(100)
    assert claim.hear_claim(claim.question()) is False
    claim.hear_answer(answer_from(claim))
    assert claim.decide() is True


def test_once_it_gave_way_it_answers_no_claim_and_hears_no_answer():
    claim = claim_at(200)
    claim.hear_claim(claim_at(100).question())
    assert claim.decide() is False
    assert claim.hear_claim(claim_at(300).question()) is False
    claim.hear_answer(answer_from(claim_at(50)))
    assert claim.kept is False


async def test_a_serving_process_stops_with_its_refusal_once_it_gives_way_and_otherwise_as_it_would():
    claim = claim_at(200)
    assert claim.decide() is True
    stopping = asyncio.Event()
    serving = asyncio.ensure_future(unless_taken(stopping.wait(), claim, "m:0-1@n"))
    await asyncio.sleep(0)
    claim.hear_answer(answer_from(claim_at(100)))  # a late answer from one whose claim ranks first
    with pytest.raises(CommandRefused, match="m:0-1@n is already served by another process") as refused:
        await asyncio.wait_for(serving, timeout=5)
    assert "\n" not in str(refused.value)
    await asyncio.wait_for(unless_taken(asyncio.sleep(0), claim_at(100), "m:0-1@n"), timeout=5)  # its stop
    with pytest.raises(ZeroDivisionError):  # what stopped it otherwise, as it was
        await asyncio.wait_for(unless_taken(_fails(), claim_at(100), "m:0-1@n"), timeout=5)


async def _fails() -> None:
    raise ZeroDivisionError


@pytest.mark.parametrize("seed", range(40))
def test_whatever_the_delays_and_orders_exactly_one_process_keeps_the_id(seed):
    # Processes subscribe, ask and decide at random times under skewed clocks; the broker delivers each claim to those
    # subscribed when it was asked and each answer to its asker, each late by up to many deadlines.
    outcomes = [_random_schedule(random.Random(seed * 100 + run)) for run in range(50)]
    assert all(kept.count(True) == 1 for kept in outcomes), outcomes


def _random_schedule(rng: random.Random) -> list[bool | None]:
    deadline_s, span_s = 1.0, rng.choice([0.5, 2.0, 10.0, 40.0])
    events: list[tuple[float, int, str, tuple]] = []

    def at(time_s: float, kind: str, *args) -> None:
        heapq.heappush(events, (time_s, len(events) + rng.random(), kind, args))

    def late() -> float:
        return rng.choice([rng.uniform(0, 0.2), rng.uniform(0, 3), rng.uniform(0, 20)])

    processes = []
    for index in range(rng.choice([2, 3, 4, 6])):
        subscribed = rng.uniform(0, span_s)
        asked = subscribed + rng.uniform(0, 1.5)
        skew_ns = int(rng.uniform(-5, 5) * 1e9)
        claim = ShardClaim(clock_ns=lambda asked=asked, skew_ns=skew_ns: int((100 + asked) * 1e9) + skew_ns)
        processes.append((claim, subscribed))
        at(asked, "ask", index)
        at(asked + deadline_s + rng.choice([0.0, rng.uniform(0, 2)]), "decide", index)
    while events:
        now, _, kind, args = heapq.heappop(events)
        if kind == "ask":
            for other, (_, subscribed) in enumerate(processes):
                if other != args[0] and subscribed < now:
                    at(now + late(), "claim", other, args[0])
        elif kind == "claim":
            hearer, asker = processes[args[0]][0], processes[args[1]][0]
            if hearer.hear_claim(asker.question()):
                at(now + late(), "answer", args[1], answer_from(hearer))
        elif kind == "answer":
            processes[args[0]][0].hear_answer(args[1])
        else:
            processes[args[0]][0].decide()
    return [claim.kept for claim, _ in processes]


def claim_message(subject: str, reply: str, body: bytes, headers: dict[str, str] | None) -> SimpleNamespace:
    return SimpleNamespace(subject=subject, reply=reply, data=body, headers=headers)


def test_on_a_community_mesh_only_a_claim_signed_with_the_node_s_key_is_a_rival_s():
    node_key, other_key = MemberKey.generate(), MemberKey.generate()
    ours, rival = ShardClaim(node_key), ShardClaim(node_key)
    subject, inbox = "hearth.ctl.n.abc", "_INBOX.n.x"
    body = rival.question().model_dump_json().encode()
    assert ours.from_this_node(claim_message(subject, inbox, body, rival.headers(subject, inbox, body)))
    # Unsigned (an orchestrator may publish on the control subject), another member's, or moved elsewhere: no rival.
    assert not ours.from_this_node(claim_message(subject, inbox, body, None))
    assert not ours.from_this_node(claim_message(subject, inbox, body, ShardClaim(other_key).headers(
        subject, inbox, body)))
    assert not ours.from_this_node(claim_message(subject, "_INBOX.n.y", body, rival.headers(subject, inbox, body)))
    # Its signature covers its rank: the same claim made out to be earlier, or with a lower nonce, is no rival's.
    for forged in (StatShard(claim=rival.nonce, claimed_at_ns=0), StatShard(claim="0" * 32,
                                                                            claimed_at_ns=rival.rank.at_ns)):
        forged_body = forged.model_dump_json().encode()
        assert not ours.from_this_node(claim_message(subject, inbox, forged_body, rival.headers(subject, inbox, body)))


def test_on_an_open_mesh_claims_go_unsigned_and_every_one_is_heard():
    claim = ShardClaim()
    assert claim.headers("hearth.ctl.n.abc", "_INBOX.x", b"{}") is None
    assert claim.from_this_node(claim_message("hearth.ctl.n.abc", "_INBOX.x", b"{}", None))

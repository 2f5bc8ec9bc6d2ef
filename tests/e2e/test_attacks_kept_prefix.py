"""Kept prefixes against faults, over real processes. A liar counting on them: a shard host that computes honestly
every session it begins from position 0 and lies only in those it begins from KV kept from an earlier call (where it
may hope no mirror can follow it) is caught all the same. The mirror is first fed what entered the hop's layers over
the kept positions (hearth/services/orchestrator/kept_inputs.py), then checked on the positions the call ran; the liar
is quarantined and the conversation's next turn answers with generate()'s tokens. And a host killed in a turn that began
from kept blocks is failed over to replicas that hold none, with the same answer."""

from __future__ import annotations

import asyncio
import signal

import pytest

from hearth.protocol.chat import ChatRequest
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME, greedy_reference
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PIPELINES_STREAM,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    failover_mesh,
    nc,
    stream_with_action,
    wait_for_event,
)

pytestmark = pytest.mark.timeout(600)

CHECKED_HOP = 1
# The honest replicas of the checked layers ask to be used last: the liar is the primary while it is live.
HONEST_CHECKED_WEIGHT = 50.0
# Small blocks so a short conversation has several; every step checked, so the test need not wait for a draw.
MESH_ENV = {"HEARTH_PREFIX_CACHE__ENABLED": "true", "HEARTH_PREFIX_CACHE__BLOCK_TOKENS": "8",
            "HEARTH_VERIFICATION__SAMPLE_RATE": "1.0", "HEARTH_VERIFICATION__CANARY_INTERVAL_S": "0"}
FIRST_TURN = ("a community of households shares one model across its machines, each holding a few layers of it, "
              "and every call streams activations from one house to the next")
# Another conversation, for the failover test: the first test's turns are kept on the replica its liar was failed
# over to, and a kept prefix of this conversation there would draw the turn away from the host to be killed.
OTHER_FIRST_TURN = ("the households of a street serve one model together on their machines, each keeping some of its "
                    "layers, and every call passes activations from one home to the next")
NEW_TOKENS = 8


def request(prompt: str) -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
    shards = [("h0", *THREE_SHARD_RANGES[0], PRIMARY_WEIGHT), ("h2", *THREE_SHARD_RANGES[2], PRIMARY_WEIGHT),
              ("r1", lo, hi, HONEST_CHECKED_WEIGHT), ("r2", lo, hi, HONEST_CHECKED_WEIGHT)]
    with failover_mesh(tmp_path_factory, tiny_models_dir, "kept-prefix-liar", extra_env=MESH_ENV) as mesh:
        yield mesh.serve(shards)


async def test_a_host_lying_only_from_kept_prefixes_is_caught(mesh, nc, tiny_models_dir):
    lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
    async with mesh.extra_shards() as start:
        liar = await start("x", lo, hi, PREFERRED_WEIGHT, "only_kept_prefix,noise=0.05")
        first = await stream_with_action(nc, request(FIRST_TURN))
        assert first.final.type == "done", first.final
        assert liar.shard_id in first.hops and not first.of_type("shard_failover"), "honest from position 0"

        second_turn = FIRST_TURN + "".join(f.text for f in first.of_type("token_delta")) + " and then some more"
        second = await stream_with_action(nc, request(second_turn))
        assert second.final.type == "done", second.final
        assert liar.shard_id in second.first_hops, "the conversation's next turn went where its prefix was kept"
        evidence = (await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type ==
                                         "integrity.mismatch_confirmed" and item.event.shard_id == liar.shard_id,
                                         timeout_s=30)).event
        assert liar.shard_id not in evidence.witnesses
        expected = await asyncio.to_thread(greedy_reference, tiny_models_dir / TINY_MODEL_NAME, second_turn,
                                           NEW_TOKENS)
        assert second.answer_token_ids == expected


async def test_a_host_killed_in_a_turn_begun_from_kept_blocks_is_failed_over_to_the_whole_prefill_s_tokens(
        mesh, nc, tiny_models_dir):
    # The replicas hold none of the conversation: the failover's chain prefills it whole, and the answer is the same.
    lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
    async with mesh.extra_shards() as start:
        victim = await start("k", lo, hi, PREFERRED_WEIGHT)
        first = await stream_with_action(nc, request(OTHER_FIRST_TURN))
        assert first.final.type == "done" and victim.shard_id in first.hops, first.final
        second_turn = OTHER_FIRST_TURN + "".join(f.text for f in first.of_type("token_delta")) + " and the next house"
        second = await stream_with_action(nc, request(second_turn), lambda: victim.process.signal(signal.SIGKILL),
                                          after_tokens=2)
        assert second.final.type == "done", second.final
        assert victim.shard_id in second.first_hops
        assert [f.failed_shard_id for f in second.of_type("shard_failover")] == [victim.shard_id]
        expected = await asyncio.to_thread(greedy_reference, tiny_models_dir / TINY_MODEL_NAME, second_turn,
                                           NEW_TOKENS)
        assert second.answer_token_ids == expected

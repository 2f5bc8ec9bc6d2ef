"""A host lying on a prompt longer than the chain's record holds, over real processes: the record
(`[verification] record_budget_mb`, tiny here) stopped at such a prompt, so its chain went unchecked and a host, which
sees a prompt's length, could lie there unseen. Checked as it streams, the lie is found in the prompt's first chunks
(still recorded from position 0, so a witness settles it), or past what the record forgot (a second replica fed beside
the mirror from the start settles it): the liar is quarantined and the answer stays honest. One
mesh serves the module: honest shards over layers 0-1 and 4-5, two honest replicas of layers 2-3; each test starts
a subtle liar (1 % noise: no guard sees it) for layers 2-3, preferred by the router."""

from __future__ import annotations

import asyncio

import pytest

from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
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
HONEST_CHECKED_WEIGHT = 50.0
# The tiny model's activations are 64 floats: a chain of 3 hops records 1 KiB a position, so 0.1 MiB holds about 100
# positions and the prompt below (a few hundred) is longer than the record holds.
MESH_ENV = {"HEARTH_VERIFICATION__RECORD_BUDGET_MB": "0.1", "HEARTH_VERIFICATION__SAMPLE_RATE": "0",
            "HEARTH_VERIFICATION__CANARY_INTERVAL_S": "0"}
LONG_PROMPT = "the quick brown fox jumps over the lazy dog; " * 16


def long_request(verify: str = "sampled") -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=LONG_PROMPT, max_tokens=8, temperature=0.0,
                       params=ChatParams(fallback_to_local=False, verify=verify))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    checked_lo, checked_hi = THREE_SHARD_RANGES[CHECKED_HOP]
    shards = [(f"h{index}", lo, hi, HONEST_CHECKED_WEIGHT if index == CHECKED_HOP else PRIMARY_WEIGHT)
              for index, (lo, hi) in enumerate(THREE_SHARD_RANGES)]
    with failover_mesh(tmp_path_factory, tiny_models_dir, "long-prompt-liar", extra_env=MESH_ENV) as mesh:
        yield mesh.serve([*shards, ("r1", checked_lo, checked_hi, HONEST_CHECKED_WEIGHT)])


@pytest.fixture(scope="module")
def reference(mesh):
    """The honest answer to the long prompt, before any liar joins."""

    async def run():
        client = await connect_nats(mesh.cluster.nats_url, name="long-prompt-reference",
                                    settings=mesh.cluster.nats_settings())
        try:
            return await stream_with_action(client, long_request())
        finally:
            await asyncio.wait_for(client.close(), timeout=5)

    call = asyncio.run(run())
    assert call.final.type == "done", call.final
    assert call.final.usage.prompt_tokens > 150, "the prompt must be longer than the record holds"
    return call


@pytest.fixture
async def liar(mesh):
    lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
    async with mesh.extra_shards() as start:
        yield lambda node_id, fault: start(node_id, lo, hi, PREFERRED_WEIGHT, fault)


# What the record holds of the chain at once, in positions (1 KiB each): past its first half it forgets what the checks
# read, so a lie found there has no fresh witness that can be fed from position 0 (the second replica fed beside the
# mirror from the start settles it).
RECORD_POSITIONS = int(float(MESH_ENV["HEARTH_VERIFICATION__RECORD_BUDGET_MB"]) * 2**20) // 1024


@pytest.mark.parametrize("level", ["sampled", "all"])
@pytest.mark.parametrize(("fault", "lies_from"), [
    ("noise=0.01", 0),
    # Honest on the prompt's first two chunks (half the record each), lying from the third: the record forgot the first.
    ("after_steps=2,noise=0.01", RECORD_POSITIONS // 2),
], ids=["from-the-start", "past-the-records-first-half"])
async def test_a_liar_on_a_prompt_longer_than_the_record_is_caught_as_the_prompt_streams_and_quarantined(
        mesh, reference, nc, liar, level, fault, lies_from):
    x = await liar(f"long-liar-{level}-{lies_from}", fault)
    call = await stream_with_action(nc, long_request(level))
    assert call.final.type == "done", call.final
    assert x.shard_id in call.hops, "the router was to pick the preferred liar first"
    assert call.of_type("shard_failover"), "the refuted call fails over around the liar"
    assert call.answer_token_ids == reference.token_ids
    stored = await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type == "integrity.mismatch_confirmed"
                                  and item.event.shard_id == x.shard_id, timeout_s=30)
    assert x.shard_id not in stored.event.witnesses
    assert stored.event.position >= lies_from, "the lie was to come past the record's first half"

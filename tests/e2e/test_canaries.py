"""Canaries over real processes: work two hosts agreed on is replayed to a third host of the same layers, as a
session it cannot tell from a call's hop; a host that answers it wrongly is quarantined with those two as
witnesses, though it never served a call, and an honest one is counted as verified. And where only two hosts
serve some layers, a disagreement between them blames nobody."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PIPELINES_STREAM,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    chat_request,
    failover_mesh,
    nc,
    read_events,
    run_reference_call,
    stream_with_action,
    wait_for_event,
)

pytestmark = pytest.mark.timeout(600)

CHECKED_HOP = 1
# A canary every second or so; a call's first step is checked on every hop (no guard has learned yet).
MESH_ENV = {"HEARTH_VERIFICATION__CANARY_INTERVAL_S": "1"}
canary_wait_s = 60.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    checked_lo, checked_hi = THREE_SHARD_RANGES[CHECKED_HOP]
    shards = [(f"h{index}", lo, hi, PRIMARY_WEIGHT) for index, (lo, hi) in enumerate(THREE_SHARD_RANGES)]
    with failover_mesh(tmp_path_factory, tiny_models_dir, "canaries", extra_env=MESH_ENV) as mesh:
        yield mesh.serve([*shards, ("r1", checked_lo, checked_hi, REPLICA_WEIGHT)])


async def test_a_host_that_never_served_a_call_is_caught_lying_by_a_canary(mesh, nc):
    call = await asyncio.to_thread(run_reference_call, mesh.cluster)  # h1 and r1 agree on its first step
    assert call.final.type == "done", call.final
    honest = {mesh.shards["h1"].shard_id, mesh.shards["r1"].shard_id}
    lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
    async with mesh.extra_shards() as start:
        liar = await start("x", lo, hi, REPLICA_WEIGHT * 2, fault="scale=40")
        stored = await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type ==
                                      "integrity.mismatch_confirmed" and item.event.shard_id == liar.shard_id,
                                      timeout_s=canary_wait_s)
        assert set(stored.event.witnesses) == honest
        assert stored.event.pipeline_id != call.pipeline_id, "caught by a canary of its own, not by a call"
        # An honest newcomer answers its canary right and is counted as verified.
        newcomer = await start("y", lo, hi, REPLICA_WEIGHT * 2)
        await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type == "integrity.shards_verified"
                             and any(s.shard_id == newcomer.shard_id for s in item.event.shards),
                             timeout_s=canary_wait_s)


async def test_two_hosts_that_disagree_with_no_third_to_settle_it_blame_nobody(mesh, nc):
    # Layers 0-1 have one honest host: a preferred liar there is checked against it, and nobody can say who lied.
    reference = await asyncio.to_thread(run_reference_call, mesh.cluster)
    lo, hi = THREE_SHARD_RANGES[0]
    async with mesh.extra_shards() as start:
        liar = await start("z", lo, hi, PREFERRED_WEIGHT, fault="scale=40")
        call = await stream_with_action(nc, chat_request())
        assert call.final.type == "done", call.final
        assert liar.shard_id in call.hops and call.of_type("shard_failover")
        assert call.answer_token_ids == reference.token_ids
        stored = await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type ==
                                      "integrity.mismatch_disputed" and liar.shard_id in item.event.shard_ids,
                                      timeout_s=canary_wait_s)
        assert set(stored.event.shard_ids) == {liar.shard_id, mesh.shards["h0"].shard_id}
        assert not any(item.event.type == "integrity.mismatch_confirmed" and item.event.shard_id == liar.shard_id
                       for item in await read_events(nc, PIPELINES_STREAM)), "nobody is quarantined on one word"

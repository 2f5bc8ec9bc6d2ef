"""Failover when a shard host dies (SIGKILL) mid-generation, with and without a replica, and hygiene: every way a
request ends frees the sessions on every hop. One mesh of real processes serves the whole module:
primaries p0-p2 (hop_weight 1) and replicas r0-r2 (hop_weight 2) over layers 0-1, 2-3, 4-5, and an orchestrator
with a 1 s step timeout that may fall back to a local copy of the model, here after one failover
(fallback_to_local_after_failures = 1). Tests run in file order and consume the mesh: each kill test kills
another primary, the no-replica tests kill replica r1, the last test kills r0."""

from __future__ import annotations

import asyncio
import signal

import pytest

from hearth.services.client.chat import stream_chat
from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    nc,
    run_reference_call,
    ACT_AFTER_TOKENS,
    MAX_TOKENS,
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    STEP_TIMEOUT_S,
    StreamedCall,
    chat_request,
    leaving_client_request,
    failover_mesh,
    pipeline_events,
    replay_pipeline,
    stream_with_action,
    wait_for_pipeline_end,
    wait_until_released,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    env = {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__FALLBACK_TO_LOCAL_AFTER_FAILURES": "1"}
    with failover_mesh(tmp_path_factory, tiny_models_dir, "failover-kill", extra_env=env) as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False)
            mesh.start_shard(f"r{index}", lo, hi, hop_weight=REPLICA_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=True)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


@pytest.fixture(scope="module")
def reference(mesh):
    """The uninterrupted greedy run every failed-over run must reproduce token for token."""

    call = run_reference_call(mesh.cluster)
    assert call.final.type == "done", call.final
    # Long enough that the kill after ACT_AFTER_TOKENS tokens lands mid-generation.
    assert call.final.finish_reason == "length" and len(call.token_ids) == MAX_TOKENS
    assert call.first_hops == [mesh.shards[f"p{i}"].shard_id for i in range(3)]
    return call


async def test_a_client_that_goes_away_has_its_hops_closed(mesh, reference, nc):
    pipeline_id = None
    tokens = 0
    async for frame in stream_chat(nc, leaving_client_request()):
        if frame.type == "pipeline":
            pipeline_id = frame.pipeline_id
        tokens += frame.type == "token_delta"
        if tokens == ACT_AFTER_TOKENS:
            break  # closing the generator unsubscribes the inbox: the client is gone
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats
    events = await pipeline_events(nc, pipeline_id)
    assert [e.event.type for e in events][-1] == "pipeline.aborted"
    assert events[-1].event.code == "client_gone"


@pytest.mark.parametrize("hop", [0, 1, 2], ids=["first-hop", "middle-hop", "last-hop"])
async def test_sigkill_mid_generation_fails_over_to_the_replica_token_for_token(mesh, reference, nc, hop):
    victim = mesh.shards[f"p{hop}"]
    replica = mesh.shards[f"r{hop}"]
    await mesh.wait_idle_in_routing(victim)  # it served the previous test's call
    call = await stream_with_action(nc, chat_request(), lambda: victim.process.signal(signal.SIGKILL))

    assert victim.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    failovers = call.of_type("shard_failover")
    assert len(failovers) == 1, failovers
    assert failovers[0].failed_shard_id == victim.shard_id
    assert replica.shard_id in failovers[0].replacement_hops
    assert victim.shard_id not in failovers[0].replacement_hops
    assert failovers[0].resumed_at_token >= ACT_AFTER_TOKENS
    degraded = call.of_type("shard_status")
    assert [(f.shard_id, f.status) for f in degraded] == [(victim.shard_id, "degraded")]
    # Found dead by its missing control responder (gone_check_after_s), not by waiting out the step timeout.
    assert "no longer connected" in degraded[0].reason, degraded[0].reason
    assert call.token_ids == reference.token_ids
    assert call.final.timing.failovers == 1

    # Audit: the replayed timeline has the failover in its place.
    await wait_for_pipeline_end(nc, call.pipeline_id)
    types = [record["event"]["type"] for record in replay_pipeline(mesh.cluster, call.pipeline_id)]
    lifecycle = [t for t in types if t in ("pipeline.constructed", "pipeline.shard_status", "pipeline.failover",
                                           "pipeline.completed")]
    assert lifecycle == ["pipeline.constructed", "pipeline.shard_status", "pipeline.failover",
                         "pipeline.completed"], types

    # Hygiene: done means every surviving hop freed its session.
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats


async def test_no_replica_aborts_with_shard_unavailable_within_the_step_timeout(mesh, reference, nc):
    # p1 died above: r1 is the only shard left for layers 2-3.
    assert not mesh.shards["p1"].process.alive
    victim = mesh.shards["r1"]
    call = await stream_with_action(nc, chat_request(fallback_to_local=False),
                                    lambda: victim.process.signal(signal.SIGKILL))

    assert call.final.type == "pipeline_aborted", call.final
    assert call.final.code == "shard_unavailable"
    assert call.of_type("shard_failover") == []
    assert [(f.shard_id, f.status) for f in call.of_type("shard_status")] == [(victim.shard_id, "degraded")]
    # The spec's bound on how long a client waits for a dead pipeline to be declared dead.
    assert call.seconds_from_action_to_end() <= STEP_TIMEOUT_S + 1.0
    assert call.token_ids == reference.token_ids[:len(call.token_ids)]
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats


async def test_nothing_to_route_to_is_shard_unavailable_or_local_fallback(mesh, reference, nc):
    refused = await stream_with_action(nc, chat_request(fallback_to_local=False))
    assert refused.final.type == "pipeline_aborted" and refused.final.code == "shard_unavailable"
    assert "2-3" in refused.final.reason

    local = await stream_with_action(nc, chat_request(fallback_to_local=True))
    assert local.final.type == "done", local.final
    assert local.token_ids == reference.token_ids


async def test_no_replica_mid_generation_falls_back_to_the_local_model(mesh, reference, nc):
    victim = mesh.start_shard("r1", 2, 3, hop_weight=REPLICA_WEIGHT)
    call = await stream_with_action(nc, chat_request(fallback_to_local=True),
                                    lambda: victim.process.signal(signal.SIGKILL))

    assert victim.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    assert call.of_type("shard_failover") == []
    assert [(f.shard_id, f.status) for f in call.of_type("shard_status")] == [(victim.shard_id, "degraded")]
    assert call.token_ids == reference.token_ids
    types = [e.event.type for e in await pipeline_events(nc, call.pipeline_id)]
    assert types.index("pipeline.shard_status") < types.index("pipeline.fallback_local") < types.index(
        "pipeline.completed")
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats


async def test_a_failure_after_the_allowed_failovers_falls_back_to_the_local_model(mesh, reference, nc):
    # One failover is allowed in this module: the second failure of the call goes local.
    # Layers 2-3 lost both their shards above: a fresh one covers them.
    fresh = [mesh.start_shard("p0-again", 0, 1, hop_weight=PRIMARY_WEIGHT, wait_ready=False),
             mesh.start_shard("r1-again", 2, 3, hop_weight=REPLICA_WEIGHT, wait_ready=False)]
    for handle in fresh:
        await asyncio.to_thread(mesh.cluster.wait_ready, handle.process)
        await mesh.wait_advertised(handle)
    first, second = fresh[0], mesh.shards["r0"]
    # The second kill waits for the failover onto `second`: timed by a token count instead, it could land before
    # a loaded orchestrator even noticed the first, leaving no replica to fail over to at all.
    call, tokens = StreamedCall(), 0
    async for frame in stream_chat(nc, chat_request(fallback_to_local=True), first_frame_timeout=60.0,
                                   frame_gap_timeout=30.0):
        call.frames.append(frame)
        tokens += frame.type == "token_delta"
        if frame.type == "token_delta" and tokens == ACT_AFTER_TOKENS:
            first.process.signal(signal.SIGKILL)
        elif frame.type == "shard_failover" and second.shard_id in frame.replacement_hops:
            second.process.signal(signal.SIGKILL)

    assert first.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    assert [f.failed_shard_id for f in call.of_type("shard_failover")] == [first.shard_id]
    assert [f.shard_id for f in call.of_type("shard_status")] == [first.shard_id, second.shard_id]
    assert call.token_ids == reference.token_ids
    types = [e.event.type for e in await pipeline_events(nc, call.pipeline_id)]
    assert types.count("pipeline.failover") == 1 and "pipeline.fallback_local" in types
    assert types[-1] == "pipeline.completed"
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats

"""Failover from shards that stay connected but misbehave: frozen (SIGSTOP), slow (`--fault delay_s`), returning
NaN or activations x 1e4; and routing health: re-advertisement, withdrawal. One mesh serves the module:
honest shards h0-h2 (hop_weight 1, with /metrics) over layers 0-1, 2-3, 4-5 and an orchestrator with a 1 s step
timeout. Each test starts its own preferred shard x (hop_weight 0.5, so it is the one routed to), breaks it
mid-generation, and stops it at the end (a stopped shard withdraws)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from events.models import ShardAdvertised, ShardWithdrawn
from services.common.nats_connection import connect_nats
from services.common.nats_server import free_tcp_port
from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.failover_support import (
    ACT_AFTER_TOKENS,
    MAX_TOKENS,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    SHARD_TTL_S,
    SHARDS_STREAM,
    chat_request,
    failover_mesh,
    pipeline_events,
    read_events,
    scrape_metric,
    stream_with_action,
    wait_for_event,
    wait_until_released,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "failover-faults") as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"h{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, metrics_port=free_tcp_port(),
                             wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        yield mesh


@pytest.fixture
async def nc(mesh):
    client = await connect_nats(mesh.cluster.nats_url, name="failover-test")
    try:
        yield client
    finally:
        await asyncio.wait_for(client.close(), timeout=5)


@pytest.fixture(scope="module")
def reference(mesh):
    async def run():
        client = await connect_nats(mesh.cluster.nats_url, name="failover-reference")
        try:
            return await stream_with_action(client, chat_request())
        finally:
            await client.close()

    call = asyncio.run(run())
    assert call.final.type == "done" and len(call.token_ids) == MAX_TOKENS, call.final
    return call


@pytest.fixture
async def preferred(mesh):
    """start(node_id, hop, fault=None): a shard for hop `hop`'s layers that the router prefers; stopped after."""
    started = []

    async def start(node_id: str, hop: int, fault: str | None = None):
        lo, hi = THREE_SHARD_RANGES[hop]
        handle = await asyncio.to_thread(mesh.start_shard, node_id, lo, hi, hop_weight=PREFERRED_WEIGHT, fault=fault)
        started.append(handle)
        await mesh.wait_advertised(handle)
        return handle

    yield start
    for handle in started:
        await asyncio.to_thread(mesh.stop_shard, handle)  # SIGCONT first, then SIGTERM: it withdraws


def assert_failed_over_once(call, reference, culprit, replacement) -> None:
    assert culprit.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    failovers = call.of_type("shard_failover")
    assert len(failovers) == 1, failovers
    assert failovers[0].failed_shard_id == culprit.shard_id
    assert replacement.shard_id in failovers[0].replacement_hops
    assert [(f.shard_id, f.status) for f in call.of_type("shard_status")] == [(culprit.shard_id, "degraded")]
    assert call.token_ids == reference.token_ids


async def test_frozen_shard_is_detected_and_failed_over(mesh, reference, nc, preferred):
    frozen = await preferred("x-frozen", 1)
    try:
        call = await stream_with_action(nc, chat_request(), lambda: frozen.process.signal(signal.SIGSTOP))
        assert_failed_over_once(call, reference, frozen, mesh.shards["h1"])
        failover = call.of_type("shard_failover")[0]
        assert failover.resumed_at_token >= ACT_AFTER_TOKENS
    finally:
        frozen.process.signal(signal.SIGCONT)
    # Thawed, it reads the close the orchestrator sent while it was frozen and frees that session.
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats


async def test_slow_shard_is_marked_degraded_and_failed_over(mesh, reference, nc, preferred):
    slow = await preferred("x-slow", 0, fault=f"after_steps={ACT_AFTER_TOKENS},delay_s=3")
    call = await stream_with_action(nc, chat_request())
    assert_failed_over_once(call, reference, slow, mesh.shards["h0"])
    assert "not passed on" in call.of_type("shard_status")[0].reason
    types = [e.event.type for e in await pipeline_events(nc, call.pipeline_id)]
    assert "pipeline.shard_status" in types and "integrity.corruption_detected" not in types


@pytest.mark.parametrize(
    ("hop", "fault", "check", "checked_by"),
    [
        (1, "after_steps=3,nan", "nan", "h2"),  # the next shard catches it on its input
        (0, "after_steps=3,scale=10000", "norm", "h1"),
        (2, "after_steps=3,scale=10000", "norm", None),  # the last hop's output: the orchestrator catches it
    ],
    ids=["nan-middle-hop", "scaled-first-hop", "scaled-last-hop"],
)
async def test_corrupting_shard_is_caught_counted_and_routed_around(mesh, reference, nc, preferred, hop, fault,
                                                                   check, checked_by):
    liar = await preferred(f"x-liar{hop}", hop, fault=fault)
    checker = mesh.shards[checked_by] if checked_by else None
    labels = {"check": check, "checked_at": "hop_input"}
    before = scrape_metric(checker.metrics_port, "hearth_integrity_failures_total", labels) if checker else 0.0

    call = await stream_with_action(nc, chat_request())

    assert_failed_over_once(call, reference, liar, mesh.shards[f"h{hop}"])
    events = await pipeline_events(nc, call.pipeline_id)
    detected = [e.event for e in events if e.event.type == "integrity.corruption_detected"]
    assert [(d.shard_id, d.check) for d in detected] == [(liar.shard_id, check)]
    if checker is not None:
        assert scrape_metric(checker.metrics_port, "hearth_integrity_failures_total", labels) == before + 1
    # The orchestrator's read model keeps it as a reputation signal.
    await mesh.wait_routing("shard_stats", liar.shard_id, lambda row: row["corruption_detections"] == 1)


async def test_withdrawn_shard_is_not_routed_to_until_it_advertises_again(mesh, reference, nc, preferred):
    node = await preferred("x-withdraws", 2)
    first = await stream_with_action(nc, chat_request(max_tokens=2))
    assert node.shard_id in first.first_hops

    await asyncio.to_thread(node.process.stop)  # SIGTERM: a clean stop publishes shard.withdrawn
    await mesh.wait_routing("shards", node.shard_id, lambda row: row["status"] == "withdrawn")
    while_gone = await stream_with_action(nc, chat_request(max_tokens=2))
    assert while_gone.final.type == "done"
    assert node.shard_id not in while_gone.first_hops and mesh.shards["h2"].shard_id in while_gone.first_hops

    back = await preferred("x-withdraws", 2)  # same node, same shard_id: it advertises again
    again = await stream_with_action(nc, chat_request(max_tokens=2))
    assert back.shard_id == node.shard_id and back.shard_id in again.first_hops


async def test_shards_re_advertise_within_their_ttl(mesh, nc):
    shard_id = mesh.shards["h0"].shard_id

    def advertisement_of_h0(item) -> bool:
        return isinstance(item.event, ShardAdvertised) and item.event.shard_id == shard_id

    first = await wait_for_event(nc, SHARDS_STREAM, advertisement_of_h0)
    later = await wait_for_event(nc, SHARDS_STREAM, lambda item: advertisement_of_h0(item) and item.seq > first.seq,
                                 timeout_s=SHARD_TTL_S * 2)
    gap_s = (later.event.occurred_at - first.event.occurred_at).total_seconds()
    # Every ttl/3: the advertisement never expires while the shard lives.
    assert 0 < gap_s < SHARD_TTL_S
    withdrawals = [e for e in await read_events(nc, SHARDS_STREAM)
                   if isinstance(e.event, ShardWithdrawn) and e.event.shard_id == shard_id]
    assert withdrawals == []

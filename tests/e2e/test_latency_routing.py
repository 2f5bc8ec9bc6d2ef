"""Routing by measured latency with real processes: of two replicas of the whole tiny model, one made slower
(every step waits SLOW_STEP_S), the router tries each (an unmeasured shard is assumed as fast as the fastest
measured one), and once both have reported their measured decode step time in a heartbeat it sends every
call to the faster one. The calls ask for no verification: a mirror check on the slow replica keeps it busy, and
the queue depth its heartbeat then reports rightly counts against it before it was ever tried."""

from __future__ import annotations

import asyncio

import pytest

from hearth.events.models import ShardHeartbeat
from hearth.events.streams import SHARDS_STREAM
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator
from tests.e2e.failover_support import wait_for_event

pytestmark = pytest.mark.timeout(300)

SLOW_STEP_S = 0.1
HEARTBEAT_S = 0.5
MAX_EXPLORING_CALLS = 8
CALLS_AFTER = 3


def greedy() -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt="The kitchen fire", max_tokens=4, temperature=0.0,
                       params=ChatParams(fallback_to_local=False, verify="none"))


@pytest.fixture
def replicas(tmp_path, tiny_models_dir):
    env = {"HEARTH_SHARD__HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S)}
    with LocalCluster(work_dir=tmp_path / "cluster", torch_threads=1, extra_env=env) as cluster:
        cluster.start_nats()
        model = str(tiny_models_dir / TINY_MODEL_NAME)
        fast = cluster.start_shard(model, 0, 5, node_id="fast", wait_ready=False)
        slow = cluster.start_shard(model, 0, 5, node_id="slow", wait_ready=False,
                                   extra_args=["--fault", f"delay_s={SLOW_STEP_S}"])
        start_orchestrator(cluster, tiny_models_dir)
        try:
            cluster.wait_all_ready()
            yield cluster, fast.ready_file.read_text().strip(), slow.ready_file.read_text().strip()
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(3000)}")


def measured(shard_id: str):
    def predicate(item) -> bool:
        event = item.event
        return (isinstance(event, ShardHeartbeat) and event.shard_id == shard_id
                and event.decode_step_ms is not None)
    return predicate


async def test_the_router_prefers_the_faster_replica_once_latency_is_measured(replicas):
    cluster: LocalCluster = replicas[0]
    fast, slow = replicas[1], replicas[2]
    nc = await connect_nats(cluster.nats_url, name="latency-routing", settings=cluster.nats_settings())
    try:
        used: list[str] = []
        latest = {}
        for _ in range(MAX_EXPLORING_CALLS):
            result = await chat(nc, greedy())
            assert result.ok, result.final
            used.append(result.frames_of("pipeline")[0].hops[0])
            # Each shard used reports its measured step time in its next heartbeat.
            latest[used[-1]] = await wait_for_event(nc, SHARDS_STREAM, measured(used[-1]), timeout_s=30)
            if len(latest) == 2:
                break
        assert set(used) == {fast, slow}, used  # the unmeasured replica was tried
        assert latest[slow].event.decode_step_ms > latest[fast].event.decode_step_ms + 0.5 * SLOW_STEP_S * 1000
        # One more heartbeat of each after those: the orchestrator's read model has long applied the first.
        for shard_id, first in latest.items():
            await wait_for_event(nc, SHARDS_STREAM, lambda item, s=shard_id, seq=first.seq: item.seq > seq
                                 and measured(s)(item), timeout_s=30)
        results = [await chat(nc, greedy()) for _ in range(CALLS_AFTER)]
        assert all(r.ok for r in results)
        assert [r.frames_of("pipeline")[0].hops for r in results] == [[fast]] * CALLS_AFTER
        assert all(r.token_ids == results[0].token_ids for r in results)
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)

"""A three-node NATS cluster across households (hearth/services/devtools/netbed.py) loses one node to a partition
mid-load: the node leads both event streams, and its household link is cut while it runs on. Calls in flight and
calls made while it is cut off complete with the undisturbed tokens, the other two nodes elect new leaders, no
event is lost or applied twice (contiguous sequences, unique event ids, the projector's read model equals a
rebuild, `hearth-replay verify` exits 0), and healed, the node rejoins with its copies of both streams caught up.

Nodes: nats-0 in the hub (with the orchestrator and the projector), nats-1 and nats-2 in households 0 and 1 of their
own; shard hosts p0-p2 in households 2-4. Every process dials nats-0 and nats-1 only: a client on the cut node
notices only by its pings (`[nats] ping_interval_s`, 10-15 s; tests/integration/test_nats_keepalive.py), which is
not what this test is about. Needs root and network namespaces; skips elsewhere."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from hearth.events.streams import ALL_STREAMS
from hearth.services.broker.cluster import EmbeddedNatsCluster
from hearth.services.broker.connection import connect_nats
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.devtools.netbed import NetBed, unavailable_reason
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.event_log_checks import assert_no_event_lost
from tests.e2e.failover_support import chat_request, pipeline_events, read_events, stream_with_action
from tests.e2e.test_nats_cluster_kill import wait_caught_up

NO_BED = unavailable_reason()
pytestmark = [pytest.mark.scheduled_first, pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(NO_BED is not None, reason=f"no multi-household test bed here: {NO_BED}")]

ROOT = Path(__file__).resolve().parents[2]
# Node i's household (None: the hub); each lives in a namespace of its own, so every node uses the same ports.
NODE_HOUSEHOLDS = (None, 0, 1)
PARTITIONED_NODE = 2
SHARD_HOUSEHOLDS = (2, 3, 4)
CLIENT_PORT, CLUSTER_PORT, MONITOR_PORT = 4222, 6222, 8222
# Calls streaming when the node is cut off.
CONCURRENT_CALLS = 2
replay_timeout_s = 120.0
leader_move_timeout_s = 30.0


def node_place(bed: NetBed, index: int):
    household = NODE_HOUSEHOLDS[index]
    return bed.hub if household is None else bed.households[household]


@pytest.fixture(scope="module")
def bed():
    with NetBed(households=len(NODE_HOUSEHOLDS) - 1 + len(SHARD_HOUSEHOLDS)) as made:
        # The tests' thread, and the processes it starts without a prefix (orchestrator, projector), live in the hub.
        with made.entered(made.hub):
            yield made


@pytest.fixture(scope="module")
def mesh(bed, tmp_path_factory, tiny_models_dir):
    work_dir = tmp_path_factory.mktemp("households-partition")
    node_addresses = [node_place(bed, index).address for index in range(len(NODE_HOUSEHOLDS))]
    with LocalCluster(work_dir=work_dir / "cluster", torch_threads=1, tls=True, tls_host_names=tuple(node_addresses),
                      prefork=False, metrics=False) as cluster:
        count = len(NODE_HOUSEHOLDS)
        cluster.start_nats(cluster_size=count, node_hosts=node_addresses, ports=[CLIENT_PORT] * count,
                           cluster_ports=[CLUSTER_PORT] * count, monitor_ports=[MONITOR_PORT] * count,
                           start_in=lambda index: bed.entered(node_place(bed, index)))
        nats_cluster: EmbeddedNatsCluster = cluster.nats
        cluster.nats_url = ",".join(node.url for index, node in enumerate(nats_cluster.nodes)
                                    if index != PARTITIONED_NODE)
        try:
            for index, household in enumerate(SHARD_HOUSEHOLDS):
                lo, hi = THREE_SHARD_RANGES[index]
                cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), lo, hi, node_id=f"p{index}",
                                    wait_ready=False, command_prefix=bed.households[household].exec_prefix())
            cluster.start_orchestrator(wait_ready=False, extra_args=["--models-dir", str(tiny_models_dir),
                                                                     "--preload", TINY_MODEL_NAME])
            cluster.start_projector(cluster.work_dir / "projector.sqlite", wait_ready=False)
            cluster.wait_all_ready()
            yield cluster
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(3000)}")


async def stream_leader(js, stream: str) -> str | None:
    try:
        return (await js.stream_info(stream)).cluster.leader
    except Exception:  # electing: the info request times out, or no leader yet
        return None


async def move_leaders_to(nc, js, node_name: str) -> None:
    """Make `node_name` lead every stream (a stepdown naming it preferred), so cutting it off forces elections."""
    deadline = time.monotonic() + leader_move_timeout_s
    for stream in ALL_STREAMS:
        while (leader := await stream_leader(js, stream)) != node_name:
            assert time.monotonic() < deadline, f"{stream} is still led by {leader}"
            if leader is not None:
                request = json.dumps({"placement": {"preferred": node_name}}).encode()
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=5)
            await asyncio.sleep(0.2)


async def wait_led_without(js, node_name: str) -> dict[str, str | None]:
    """Each stream's leader, once none is `node_name` or missing (the last seen when leader_move_timeout_s ends)."""
    deadline = time.monotonic() + leader_move_timeout_s
    while True:
        leaders = {stream: await stream_leader(js, stream) for stream in ALL_STREAMS}
        if all(leader not in (None, node_name) for leader in leaders.values()) or time.monotonic() > deadline:
            return leaders
        await asyncio.sleep(0.2)


def replay_verify(cluster: LocalCluster) -> subprocess.CompletedProcess:
    """`hearth-replay verify` as an auditor of the community."""
    env = {**os.environ, **cluster.credentials_env(cluster.member_key("auditor", "auditor")), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "hearth.services.replay.cli", "verify", "--nats", cluster.nats_url],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=replay_timeout_s)


async def test_a_partitioned_nats_node_loses_no_event_and_rejoins(bed, mesh, tmp_path):
    victim = mesh.nats.nodes[PARTITIONED_NODE]
    cut_household = NODE_HOUSEHOLDS[PARTITIONED_NODE]
    nc = await connect_nats(mesh.nats_url, name="partition-test", settings=mesh.nats_settings())
    try:
        js = nc.jetstream()
        solo = await stream_with_action(nc, chat_request())
        assert solo.final.type == "done", solo.final
        await move_leaders_to(nc, js, victim.name)

        async def one_call(cuts: bool):
            return await stream_with_action(nc, chat_request(), (lambda: bed.cut(cut_household)) if cuts else None)

        try:
            in_flight = await asyncio.gather(*(one_call(cuts=index == 0) for index in range(CONCURRENT_CALLS)))
            while_cut = await stream_with_action(nc, chat_request())
            # The majority elects new leaders for the streams the cut-off node led.
            leaders = await wait_led_without(js, victim.name)
        finally:
            await asyncio.to_thread(bed.heal, cut_household)
        for call in [*in_flight, while_cut]:
            assert call.final.type == "done", call.final
            assert call.token_ids == solo.token_ids
            assert call.of_type("shard_status") == [] and call.of_type("shard_failover") == []
            events = await pipeline_events(nc, call.pipeline_id)
            # Just after the heal, a read served by the node that rejoined may not hold yet what the wait for the
            # call's end saw stored: read again, for a while, until the completed shows.
            for _ in range(50):
                if any(item.event.type == "pipeline.completed" for item in events):
                    break
                await asyncio.sleep(0.2)
                events = await pipeline_events(nc, call.pipeline_id, ended=False)
            # Ended completed, once, after all else it recorded. By its time, not by stream order: once, a first_token
            # whose publish went through a leader change was stored after the completed (the read model keeps a
            # terminal status whatever comes after it).
            completed = [item for item in events if item.event.type == "pipeline.completed"]
            assert len(completed) == 1, [item.event.type for item in events]
            assert all(item.event.occurred_at <= completed[0].event.occurred_at for item in events)

        assert all(leader not in (None, victim.name) for leader in leaders.values()), leaders
        await wait_caught_up(js, victim)
        assert victim.monitor("routez")["num_routes"] > 0

        for process in [p for p in mesh.processes if p.name.startswith("shard-")]:
            await asyncio.to_thread(process.stop)  # heartbeats end: the log stands still
        await assert_no_event_lost(nc, mesh.work_dir / "projector.sqlite", tmp_path / "rebuilt.sqlite")
        for stream in ALL_STREAMS:
            ids = Counter(item.event.event_id for item in await read_events(nc, stream))
            assert [event_id for event_id, stored in ids.items() if stored > 1] == [], stream
        audit = await asyncio.to_thread(replay_verify, mesh)
        assert audit.returncode == 0, audit.stdout + audit.stderr
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)

"""A mesh on a three-node NATS cluster loses one node mid-generation (SIGKILL): the generation completes with the
same tokens as an undisturbed one, no acknowledged event is lost (contiguous sequences, the projector's read
model equals a rebuild), and the node rejoins, its copies of both streams caught up. The calling client is on the
killed node too, or on a surviving one: frames it missed while it reconnected are sent again, in order."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from hearth.events.streams import ALL_STREAMS
from hearth.services.broker.cluster import ClusterNodeServer, EmbeddedNatsCluster
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import three_shard_mesh
from tests.e2e.event_log_checks import assert_no_event_lost
from tests.e2e.failover_support import chat_request, pipeline_events, stream_with_action

pytestmark = [pytest.mark.scheduled_first, pytest.mark.e2e, pytest.mark.timeout(300)]

ORCHESTRATOR_CONNECTION = "hearth-orchestrator orchestrator"
rejoin_timeout_s = 30.0
# Connections made until one lands on the node asked for (nats-py picks a random node of the list).
placement_attempts = 40


def node_serving(nodes: list[ClusterNodeServer], connection_name: str) -> ClusterNodeServer:
    """The node among `nodes` (all running) a named client connection is on (its /connz lists it)."""
    for node in nodes:
        connections = node.monitor("connz?limit=1024").get("connections") or []
        if any(connection.get("name") == connection_name for connection in connections):
            return node
    raise AssertionError(f"no node serves {connection_name!r}")


async def connect_on(mesh, nodes: list[ClusterNodeServer], node: ClusterNodeServer, name: str):
    """A client connection (given the whole node list, so it can reconnect to any) that `node` serves."""
    for _ in range(placement_attempts):
        nc = await connect_nats(mesh.nats_url, name=name, settings=mesh.nats_settings())
        if node_serving(nodes, name) is node:
            return nc
        await asyncio.wait_for(nc.close(), timeout=5)
    raise AssertionError(f"{placement_attempts} connections, none on {node.name}")


async def stream_peers(js, stream: str) -> dict[str, bool]:
    """Each peer of `stream`'s copies and whether it is current; none while the stream's info does not answer
    (while a restarted node rejoins, the stream may be electing a leader: its info request times out)."""
    try:
        cluster = (await js.stream_info(stream)).cluster
    except nats.errors.TimeoutError:
        return {}
    return {cluster.leader: True, **{peer.name: bool(peer.current) for peer in cluster.replicas or []}}


async def wait_caught_up(js, node: ClusterNodeServer) -> None:
    """Every stream lists `node` among its peers and every peer is current: the node rejoined and caught up."""
    deadline = time.monotonic() + rejoin_timeout_s
    while True:
        states = {stream: await stream_peers(js, stream) for stream in ALL_STREAMS}
        if all(node.name in peers and all(peers.values()) for peers in states.values()):
            return
        assert time.monotonic() < deadline, f"{node.name} did not catch up: {states}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("caller_on_victim", [True, False], ids=["caller-on-the-killed-node", "caller-elsewhere"])
async def test_a_nats_node_killed_mid_generation_loses_nothing_and_rejoins(tmp_path, tiny_models_dir, caller_on_victim):
    projector_db = tmp_path / "projector.sqlite"
    with three_shard_mesh(tmp_path / "mesh", tiny_models_dir, nats_options={"cluster_size": 3},
                          projector_db=projector_db) as mesh:
        nats_cluster: EmbeddedNatsCluster = mesh.nats
        nc = await connect_nats(mesh.nats_url, name="cluster-kill-test", settings=mesh.nats_settings())
        try:
            js = nc.jetstream()
            solo = await stream_with_action(nc, chat_request())
            assert solo.final.type == "done", solo.final

            # The node the orchestrator is on: it, and every shard host or client there, must reconnect to
            # another node while the call streams; the event streams lose one of their three copies.
            victim = node_serving(nats_cluster.nodes, ORCHESTRATOR_CONNECTION)
            survivors = [node for node in nats_cluster.nodes if node is not victim]

            async def kill_victim() -> None:
                await asyncio.to_thread(victim.stop, kill=True)

            caller_node = victim if caller_on_victim else survivors[0]
            caller = await connect_on(mesh, nats_cluster.nodes, caller_node, "cluster-kill-caller")
            try:
                in_flight = await stream_with_action(caller, chat_request(), kill_victim)
                assert caller.stats["reconnects"] == (1 if caller_on_victim else 0)
            finally:
                await asyncio.wait_for(caller.close(), timeout=5)
            assert in_flight.final.type == "done", in_flight.final
            assert in_flight.token_ids == solo.token_ids
            assert in_flight.of_type("shard_status") == [] and in_flight.of_type("shard_failover") == []
            # The orchestrator reconnected to a survivor (node_serving fails when none lists it); the killed
            # node's monitoring port is gone with it, so only the survivors are asked.
            node_serving(survivors, ORCHESTRATOR_CONNECTION)
            events = await pipeline_events(nc, in_flight.pipeline_id)
            assert events[-1].event.type == "pipeline.completed"

            await asyncio.to_thread(victim.start)
            await asyncio.to_thread(victim.wait_healthy)
            await wait_caught_up(js, victim)
            assert victim.monitor("routez")["num_routes"] > 0

            for process in [p for p in mesh.processes if p.name.startswith("shard-")]:
                await asyncio.to_thread(process.stop)  # heartbeats end: the log stands still
            await assert_no_event_lost(nc, projector_db, tmp_path / "rebuilt.sqlite")
        finally:
            await asyncio.wait_for(nc.close(), timeout=5)

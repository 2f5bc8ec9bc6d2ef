"""hearth's NATS cluster as real processes: `hearth nats --cluster 3` serves the event streams with three copies
and stops every node on a signal; a community cluster admits members only, and only nodes that know the
community's route password join it; a single server keeps its streams at one copy, and a one-copy stream on
a cluster is scaled to three."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hearth.events import SHARDS_STREAM, ensure_streams, publish_event
from hearth.events.streams import SHARDS_STREAM_SPEC
from hearth.events.models import ShardHeartbeat
from hearth.services.broker.streams import create_community_streams
from hearth.services.common.config import NatsSettings
from hearth.services.broker.cluster import (
    ClusterNodeServer,
    EmbeddedNatsCluster,
    community_route_password,
    random_route_password,
)
from hearth.services.broker.connection import BrokerRefusedCredentials, connect_nats
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.tls import write_throwaway_ca
from hearth.trust.community import Community

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
wait_timeout_s = 30.0


def heartbeat(n: int) -> ShardHeartbeat:
    return ShardHeartbeat(node_id="node-a", shard_id="tiny/m:0-1@node-a", queue_depth=0, active_streams=0,
                          p95_latency_ms=1.0, tokens_served_total=n)


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError("no run of free ports")


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def stream_replicas(url: str, settings: NatsSettings | None = None,
                          steward_key: Path | None = None) -> tuple[int, list[str]]:
    """Ensure the streams (as the steward, given its key), store one event; the shard stream's configured
    replicas and the nodes holding it."""
    if steward_key is not None:
        await create_community_streams(settings.model_copy(update={"url": url}), steward_key, ready_timeout_s=30)
    nc = await connect_nats(url, name="test-cluster", settings=settings)
    try:
        js = nc.jetstream()
        if steward_key is None:
            await ensure_streams(js)
        await publish_event(js, heartbeat(1))
        info = await js.stream_info(SHARDS_STREAM)
        peers = [] if info.cluster is None else [info.cluster.leader] + [
            peer.name for peer in info.cluster.replicas or []]
        return info.config.num_replicas, sorted(peers)
    finally:
        await nc.close()


def test_hearth_nats_cluster_3_keeps_three_copies_of_each_stream_and_stops_every_node(tmp_path):
    ports, cluster_ports, monitor_ports = free_port_run(3), free_port_run(3), free_port_run(3)
    process = subprocess.Popen(
        [sys.executable, "-m", "hearth.services.cli", "nats", "--cluster", "3", "--port", str(ports),
         "--cluster-port", str(cluster_ports), "--monitor-port", str(monitor_ports), "--store", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = process.stdout.readline().strip()
        assert url == ",".join(f"nats://127.0.0.1:{ports + i}" for i in range(3)), process.stderr.read()
        replicas, peers = asyncio.run(stream_replicas(url))
        assert (replicas, peers) == (3, ["nats-0", "nats-1", "nats-2"])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["nats-0", "nats-1", "nats-2"]

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        listened = [*range(ports, ports + 3), *range(cluster_ports, cluster_ports + 3)]
        assert not any(port_is_open(port) for port in listened)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_a_single_server_keeps_one_copy(nats_server):
    replicas, _ = asyncio.run(stream_replicas(nats_server.url))
    assert replicas == 1


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + wait_timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_community_cluster_admits_members_only_and_routes_need_the_community_password(tmp_path):
    community = Community.init(tmp_path / "community", "cluster-test")
    community.add("node-a", "shard")
    tls = write_throwaway_ca(tmp_path / "tls")
    tls_settings = dict(tls_ca_file=tls.ca_file, tls_cert_file=tls.client_cert_file, tls_key_file=tls.client_key_file)
    authorization = render_authorization(community.roster())
    with EmbeddedNatsCluster(3, store_dir=tmp_path / "nats", authorization=authorization, tls_block=tls.server_block(),
                             route_password=community_route_password(community)) as cluster:
        member = NatsSettings(creds_file=community.directory / "keys" / "node-a.nk", **tls_settings)
        # Only the steward creates the streams; the member publishes its own events into them.
        assert asyncio.run(stream_replicas(cluster.url, member, community.system_key_path)) == (
            3, ["nats-0", "nats-1", "nats-2"])
        stranger = NatsSettings(connect_timeout_s=5, **tls_settings)
        with pytest.raises(BrokerRefusedCredentials):
            asyncio.run(connect_nats(cluster.url, settings=stranger))

        routes = [node.cluster_listen for node in cluster.nodes]
        intruder = ClusterNodeServer(name="intruder", routes=routes, route_password=random_route_password(),
                                     cluster_listen=f"127.0.0.1:{free_port_run(1)}", store_dir=tmp_path / "intruder")
        with intruder:
            wait_until(lambda: "authorization violation" in intruder.log_tail(20000).lower(),
                       "the intruder was never refused")
            for node in cluster.nodes:
                assert "intruder" not in {route.get("remote_name") for route in node.monitor("routez")["routes"]}


async def test_a_one_copy_stream_on_a_cluster_is_scaled_to_three(nats_cluster):
    nc = await connect_nats(nats_cluster.url, name="test-scale")
    try:
        js = nc.jetstream()
        await js.add_stream(SHARDS_STREAM_SPEC.config(replicas=1))
        await publish_event(js, heartbeat(1))
        await ensure_streams(js)
        deadline = time.monotonic() + wait_timeout_s
        while len((info := await js.stream_info(SHARDS_STREAM)).cluster.replicas or []) < 2:
            assert time.monotonic() < deadline, info.cluster
            await asyncio.sleep(0.05)
        assert info.config.num_replicas == 3 and info.state.messages == 1
    finally:
        await nc.close()

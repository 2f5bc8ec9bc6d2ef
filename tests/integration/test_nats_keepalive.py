"""A client notices a NATS node that stops answering while its connection stays open (a partitioned node, here
SIGSTOPped) by its pings ([nats] ping_interval_s, max_outstanding_pings), reconnects to another node of the
cluster, and publishes and receives there again; the settings reach every connection connect_nats opens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from hearth.services.broker.cluster import EmbeddedNatsCluster
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.common.config import NatsSettings, load_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SUBJECT = "test.keepalive"
ECHO_SUBJECT = "test.keepalive.echo"
# Short pings so the test waits seconds, not the defaults' 10-15 s; the connect timeout bounds an attempt that
# lands on the stopped node (its kernel still accepts the TCP connection, but it never says hello).
ping_interval_s = 1.0
max_outstanding_pings = 2
connect_timeout_s = 2.0
# Slack on top of the bound the settings promise, for a loaded machine; nats-py's own pings (every 120 s) would
# leave the client on the stopped node far beyond it.
reconnect_slack_s = 20.0
message_timeout_s = 10.0
republish_wait_s = 0.5


def node_port(nc) -> int:
    return nc.connected_url.port


async def published_until_received(publisher, subject: str, data: bytes, inbox: asyncio.Queue) -> None:
    """Publish `data` until `inbox` gets it (copies of an earlier message still arriving are passed over): a
    subscription reaches the cluster's other nodes a moment after the node it was made on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + message_timeout_s
    while True:
        await publisher.publish(subject, data)
        resend_at = loop.time() + republish_wait_s
        with contextlib.suppress(TimeoutError):
            while (remaining_s := resend_at - loop.time()) > 0:
                if await asyncio.wait_for(inbox.get(), remaining_s) == data:
                    return
        assert loop.time() < deadline, f"{data!r} never arrived on {subject}"


async def test_a_client_on_a_stopped_node_reconnects_to_another_and_messages_flow_again(tmp_path):
    settings = NatsSettings(ping_interval_s=ping_interval_s, max_outstanding_pings=max_outstanding_pings,
                            connect_timeout_s=connect_timeout_s, reconnect_wait_s=0.2)
    with EmbeddedNatsCluster(3, store_dir=tmp_path / "nats") as cluster:
        reconnected = asyncio.Event()
        client = await connect_nats(cluster.url, name="keepalive-client", settings=settings,
                                    on_reconnected=reconnected.set)
        stopped = next(node for node in cluster.nodes if node.port == node_port(client))
        survivor = next(node for node in cluster.nodes if node is not stopped)
        peer = await connect_nats(survivor.url, name="keepalive-peer", settings=settings)
        try:
            received: asyncio.Queue = asyncio.Queue()
            echoed: asyncio.Queue = asyncio.Queue()

            async def on_message(msg) -> None:
                await received.put(msg.data)

            async def on_echo(msg) -> None:
                await echoed.put(msg.data)

            await client.subscribe(SUBJECT, cb=on_message)
            await flush_ordered(client)
            await peer.subscribe(ECHO_SUBJECT, cb=on_echo)
            await flush_ordered(peer)
            await published_until_received(peer, SUBJECT, b"before", received)

            os.kill(stopped.pid, signal.SIGSTOP)
            try:
                bound_s = ping_interval_s * (max_outstanding_pings + 1) + connect_timeout_s
                await asyncio.wait_for(reconnected.wait(), bound_s + reconnect_slack_s)
                assert node_port(client) != stopped.port
                # The subscription moved with the client: a message from a node that never stopped reaches it,
                # and what the client publishes reaches a subscriber there.
                await client.flush(timeout=message_timeout_s)
                await published_until_received(peer, SUBJECT, b"after", received)
                await published_until_received(client, ECHO_SUBJECT, b"echo", echoed)
            finally:
                os.kill(stopped.pid, signal.SIGCONT)
        finally:
            await client.close()
            await peer.close()


async def test_the_keepalive_settings_reach_the_connection(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_NATS__PING_INTERVAL_S", "7.5")
    monkeypatch.setenv("HEARTH_NATS__MAX_OUTSTANDING_PINGS", "4")
    settings = load_settings(None).nats
    nc = await connect_nats(nats_server.url, name="keepalive-options", settings=settings)
    try:
        assert (nc.options["ping_interval"], nc.options["max_outstanding_pings"]) == (7.5, 4)
    finally:
        await nc.close()


async def test_connections_ping_by_default_often_enough_to_notice_a_dead_link_within_twenty_seconds(nats_server):
    nc = await connect_nats(nats_server.url, name="keepalive-defaults")
    try:
        noticed_within_s = nc.options["ping_interval"] * (nc.options["max_outstanding_pings"] + 1)
        assert noticed_within_s <= 20
        # A pong may come this late before the client gives up on the link: a loaded machine's few seconds pass.
        assert nc.options["ping_interval"] * nc.options["max_outstanding_pings"] >= 5
    finally:
        await nc.close()

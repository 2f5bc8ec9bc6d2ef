"""A shard host's withdrawal is said once (advertisements and heartbeats are sent again, it is not): made while the
broker is down, it is kept in the host's event outbox and written once one can be, by the next host of that node."""

from __future__ import annotations

import asyncio

import pytest

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.streams import SHARDS_STREAM
from hearth.services.broker.connection import connect_nats
from tests.integration.tiny_shard_server import tiny_shard_server

pytestmark = pytest.mark.integration

WAIT_S = 10.0


async def shard_events(nats_url: str) -> list[StoredEvent]:
    nc = await connect_nats(nats_url, name="shard-events-reader")
    try:
        async with asyncio.timeout(WAIT_S):
            return [message async for message in read_stream(nc.jetstream(), SHARDS_STREAM)
                    if isinstance(message, StoredEvent) and message.event.type != "shard.heartbeat"]
    finally:
        await nc.close()


async def test_a_withdrawal_made_while_the_broker_is_down_is_written_by_the_next_host_of_the_node(nats_server,
                                                                                                   tmp_path):
    outbox = tmp_path / "shard-outbox"
    async with tiny_shard_server(nats_server.url, outbox_dir=outbox) as first:
        nats_server.stop()
        await first.server.stop()  # withdraws: no broker to take it
    nats_server.start()
    async with tiny_shard_server(nats_server.url, outbox_dir=outbox):
        stored = await shard_events(nats_server.url)
    kinds = [(message.event.type, getattr(message.event, "reason", None)) for message in stored]
    assert kinds[:3] == [("shard.advertised", None), ("shard.withdrawn", "shutdown"), ("shard.advertised", None)]
    assert stored[1].event.occurred_at < stored[2].event.occurred_at  # said before the next host advertised

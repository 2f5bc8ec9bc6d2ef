"""EventOutbox.flush waits for nothing while its events cannot be stored (`unsendable`: the broker refuses the process's
key), so a stopping process does not wait its timeout out for a withdrawal that is kept for the next run anyway."""

from __future__ import annotations

import asyncio

from hearth.events.models import ShardWithdrawn
from hearth.events.outbox import EventOutbox
from tests.outbox_brokers import BrokerStoringNothing

NEVER_S = 600.0  # the flush's own timeout: the refusal, not this, ends it
SOON_S = 10.0


async def waiting_outbox(unsendable: asyncio.Event) -> EventOutbox:
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=4, retry_wait_s=0.01, unsendable=unsendable)
    outbox.start()
    await outbox.record(ShardWithdrawn(node_id="n", shard_id="s1", reason="shutdown"))
    return outbox


async def test_a_flush_while_the_broker_refuses_the_key_returns_at_once_with_the_event_still_waiting():
    refused = asyncio.Event()
    refused.set()
    outbox = await waiting_outbox(refused)
    try:
        async with asyncio.timeout(SOON_S):
            assert not await outbox.flush(NEVER_S)
        assert outbox.depth == 1
    finally:
        await outbox.stop(0.0)


async def test_a_flush_under_way_ends_when_the_broker_starts_refusing_the_key():
    refused = asyncio.Event()
    outbox = await waiting_outbox(refused)
    try:
        flushing = asyncio.ensure_future(outbox.flush(NEVER_S))
        await asyncio.sleep(0.05)
        assert not flushing.done()  # waiting, as for a broker that is only slow or restarting
        refused.set()
        async with asyncio.timeout(SOON_S):
            assert not await flushing
    finally:
        await outbox.stop(0.0)

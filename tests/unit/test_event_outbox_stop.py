"""EventOutbox.stop with a broker that stores nothing: it gives up after its timeout and leaves no task behind."""

from __future__ import annotations

import asyncio

from hearth.events.models import ShardWithdrawn
from hearth.events.outbox import EventOutbox
from tests.outbox_brokers import BrokerStoringNothing


async def test_stop_after_its_timeout_leaves_no_task_pending():
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=4, retry_wait_s=0.01)
    before = asyncio.all_tasks()
    outbox.start()
    for shard_id in ("s1", "s2"):  # one being written, one waiting behind it
        await outbox.record(ShardWithdrawn(node_id="n", shard_id=shard_id, reason="shutdown"))

    await outbox.stop(timeout_s=0.05)

    left = [task for task in asyncio.all_tasks() - before if not task.done()]
    assert left == []

"""A scheduler loop stopped (its task cancelled: ShardCompute.close, HeadSteps.close) while it waits for a batch's
items ends, even when an item arrives in that same turn: on Python 3.11 a wait_for whose wait was just over
swallowed the cancellation, the loop went on, and the close awaiting it never returned."""

from __future__ import annotations

import asyncio

from hearth.services.common.batching import ReadyQueue


async def _scheduler(queue: ReadyQueue) -> None:
    while True:
        batch = await queue.next_batch()
        if batch is not None:
            batch.scatter([None] * len(batch))


async def test_a_scheduler_cancelled_as_an_item_arrives_ends():
    queue: ReadyQueue[int] = ReadyQueue(window_s=1.0, max_rows=8, open_streams=lambda: 8)
    loop = asyncio.create_task(_scheduler(queue))
    queue.put(1)
    await asyncio.sleep(0.01)  # the loop waits in the batch window for the other streams' items
    queue.put(2)  # an item arrives in the very turn the loop is cancelled
    loop.cancel()
    await asyncio.wait({loop}, timeout=2)

    assert loop.cancelled()


async def test_a_scheduler_cancelled_as_its_first_item_arrives_ends():
    queue: ReadyQueue[int] = ReadyQueue(window_s=1.0, max_rows=8, open_streams=lambda: 1)
    loop = asyncio.create_task(_scheduler(queue))
    await asyncio.sleep(0.01)  # the loop waits for a first item
    queue.put(1)
    loop.cancel()
    await asyncio.wait({loop}, timeout=2)

    assert loop.cancelled()

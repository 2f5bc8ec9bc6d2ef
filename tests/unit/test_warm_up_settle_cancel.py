"""A call cancelled (its client left) while it waits for a warm-up bringing in its blocks ends there, even when the
warm-up ends in that same turn: on Python 3.11 a wait_for whose wait was just over swallowed the cancellation, and
the call went on routing for a client that had gone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.services.orchestrator.answer_kv import AnswerWarmUps


async def test_a_call_cancelled_as_the_warm_up_it_waits_for_ends_is_cancelled():
    warm_ups = AnswerWarmUps()
    builder = SimpleNamespace(kept=None, warm_up=SimpleNamespace(hashes=["a" * 32]))
    warm_ups.expect(builder, timeout_s=5.0)
    went_on: list[bool] = []

    async def call() -> None:
        await warm_ups.settle(["a" * 32])
        went_on.append(True)
        await asyncio.Event().wait()  # routing, prefilling...

    task = asyncio.create_task(call())
    await asyncio.sleep(0.01)  # waiting for the warm-up
    warm_ups.forget(builder)  # the warm-up ends in the very turn the client leaves
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    if not task.done():
        task.cancel()

    assert went_on == []


async def test_a_call_cancelled_as_a_shard_gets_room_is_cancelled():
    from hearth.services.orchestrator.capacity import ShardLoad

    load = ShardLoad(retry_s=1.0)
    load.hold(["s"])
    went_on: list[bool] = []

    async def call() -> None:
        await load.wait_for_room(5.0)
        went_on.append(True)
        await asyncio.Event().wait()  # planning again, opening hops...

    task = asyncio.create_task(call())
    await asyncio.sleep(0.01)  # waiting for room
    load.release(["s"])  # another call's stream ends in the very turn this call's client leaves
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    if not task.done():
        task.cancel()

    assert went_on == []

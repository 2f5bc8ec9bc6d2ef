"""A control request cancelled (the shard stopping) while it checks the claim, which is long decided, ends there:
on Python 3.11 a wait_for whose inner wait is already over swallowed the cancellation, and the request went on to
open a hop or wait for the compute thread while its server stopped."""

from __future__ import annotations

import asyncio

from hearth.services.shard.claim import ShardClaim


async def test_a_request_cancelled_while_it_checks_a_decided_claim_ends():
    claim = ShardClaim()
    claim.decide()

    async def answer() -> None:
        for _ in range(20):  # one cancellation lands in each of the first turns of the loop
            await claim.settle(5.0)
        await asyncio.Event().wait()  # the work after the check: a compute-thread wait, say

    for turns in range(5):
        task = asyncio.create_task(answer())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task}, timeout=1)
        assert task.cancelled(), f"cancelled after {turns} turns, the request went on"

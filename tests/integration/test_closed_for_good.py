"""A connection connect_nats made stays closed once closed, even when nats-py's reconnect loop survives the close's
cancellation (asyncio.wait_for on Python 3.11 drops one landing in the turn a connect completes): the loop is ended
and the connection is closed again, instead of reconnecting for ever and holding a shutdown's task cancellation."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NatsClient

from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import NatsSettings

pytestmark = pytest.mark.integration
# The cancellations the stand-in loop drops before it lets one end it.
DROPPED_CANCELLATIONS = 3


async def a_loop_that_drops_cancellations(nc: NatsClient, dropped: int, attempts: list[int]) -> None:
    """What nats-py's reconnect loop does after a dropped cancellation: the status set back to reconnecting, another
    attempt after each wait."""
    while True:
        try:
            attempts.append(1)
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if dropped == 0:
                raise
            dropped -= 1
            nc._status = NatsClient.RECONNECTING


async def test_a_reconnect_loop_that_survives_close_is_ended_and_the_connection_stays_closed(nats_server):
    nc = await connect_nats(nats_server.url, name="test-closed", settings=NatsSettings(url=nats_server.url))
    attempts: list[int] = []
    stubborn = asyncio.get_running_loop().create_task(
        a_loop_that_drops_cancellations(nc, DROPPED_CANCELLATIONS, attempts))
    nc._reconnection_task = stubborn  # where nats-py keeps its reconnect loop (closed_for_good.py reads it there)

    await asyncio.wait_for(nc.close(), timeout=10)

    assert stubborn.done() and stubborn.cancelled()
    assert nc.is_closed
    attempts_at_close = len(attempts)
    await asyncio.sleep(0.1)
    assert len(attempts) == attempts_at_close, "the loop went on after the close"


async def test_a_close_without_a_reconnect_under_way_is_as_before(nats_server):
    nc = await connect_nats(nats_server.url, name="test-closed", settings=NatsSettings(url=nats_server.url))
    await asyncio.wait_for(nc.close(), timeout=10)
    assert nc.is_closed
    assert not [task for task in asyncio.all_tasks() if "_attempt_reconnect" in repr(task.get_coro())]

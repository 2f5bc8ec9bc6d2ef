"""A service stopping by cancellation while it drains its NATS connection ends cancelled: on Python 3.11
asyncio.wait_for returned as the drain ended and dropped a cancellation landing then, and nats-py's drain swallows a
CancelledError of its own. The drain keeps its timeout (then the connection is closed). No network: stand-ins."""

from __future__ import annotations

import asyncio

import pytest

from hearth.services.broker.connection import drain_or_close

settle_timeout_s = 5.0


class _Connection:
    """A connection whose drain ends when `drained` is set; `swallowing`: its drain, as nats-py's does, swallows a
    CancelledError (and goes on as if drained)."""

    def __init__(self, swallowing: bool = False) -> None:
        self.is_closed = False
        self.drained = asyncio.Event()
        self.swallowing = swallowing
        self.closes = 0

    async def drain(self) -> None:
        try:
            await self.drained.wait()
        except asyncio.CancelledError:
            if not self.swallowing:
                raise
        self.is_closed = True

    async def close(self) -> None:
        self.closes += 1
        self.is_closed = True


async def _settled(task: asyncio.Task) -> asyncio.Task:
    await asyncio.wait({task}, timeout=settle_timeout_s)
    assert task.done()
    return task


@pytest.mark.parametrize("turns_between", [0, 1])
async def test_a_stop_landing_as_the_drain_ends_is_kept(turns_between):
    """The stop lands in the turn the drain ends (0: with it; 1: the turn after, as the drainer is told): a drainer
    still running then ends cancelled, not as if the stop never came."""
    connection = _Connection()
    draining = asyncio.create_task(drain_or_close(connection, timeout_s=settle_timeout_s))
    await asyncio.sleep(0.05)
    connection.drained.set()
    for _ in range(turns_between):
        await asyncio.sleep(0)
    stop_reached_it = draining.cancel()
    assert (await _settled(draining)).cancelled() == stop_reached_it


async def test_a_stop_the_drain_swallows_is_kept():
    connection = _Connection(swallowing=True)
    draining = asyncio.create_task(drain_or_close(connection, timeout_s=settle_timeout_s))
    await asyncio.sleep(0.05)
    draining.cancel()
    assert (await _settled(draining)).cancelled()


async def test_a_drain_that_outlasts_its_timeout_gives_way_to_a_close():
    for swallowing in (False, True):
        connection = _Connection(swallowing=swallowing)
        draining = await _settled(asyncio.create_task(drain_or_close(connection, timeout_s=0.05)))
        assert not draining.cancelled() and draining.exception() is None
        assert connection.is_closed
        assert swallowing or connection.closes == 1

"""The consumer sweep stopped (cancelled) in the very turn its connect to the broker returns stops, and closes the
connection it just made: nats-py's connect waits with asyncio.wait_for, which on Python 3.11 would hand it the
connection and drop the cancellation (consumer_sweep.py, connection.py `connected_keeping_cancellation`)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from hearth.services.broker import consumer_sweep
from hearth.services.broker.consumer_sweep import ConsumerCreators, ConsumerSweeper


class _Connection:
    """What the sweep does with a connection: subscribe (waits for ever, as a broker gone quiet), close."""

    def __init__(self) -> None:
        self.is_closed = False
        self.subscribed = False

    async def subscribe(self, *_args, **_kwargs) -> None:
        self.subscribed = True
        await asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        self.is_closed = True


class _ConnectingAsTheStopLands:
    """connect_nats as nats-py's is on Python 3.11 when the broker's answer and a cancellation land in the same turn:
    it returns the connection and the cancellation is gone."""

    def __init__(self) -> None:
        self.made: list[_Connection] = []
        self.waiting = asyncio.Event()

    async def __call__(self, *_args, **_kwargs) -> _Connection:
        self.waiting.set()
        try:
            await asyncio.get_running_loop().create_future()  # the broker's INFO, on its way
        except asyncio.CancelledError:
            pass  # ... arrives in the turn the stop lands: wait_for returns the connection
        self.made.append(_Connection())
        return self.made[-1]


async def test_the_sweep_stopped_as_it_connects_stops_and_closes_that_connection(monkeypatch):
    connect = _ConnectingAsTheStopLands()
    monkeypatch.setattr(consumer_sweep, "connect_nats", connect)
    sweeper = object.__new__(ConsumerSweeper)  # only what the sweep loop reads before its first sweep
    sweeper.settings = SimpleNamespace(url="nats://unused", close_timeout_s=1.0)
    sweeper.creators = ConsumerCreators()
    sweeper.watching = threading.Event()
    sweeper._stop = threading.Event()

    sweeping = asyncio.create_task(sweeper._sweep_until_stopped())
    await connect.waiting.wait()
    sweeping.cancel()
    await asyncio.wait({sweeping}, timeout=2.0)  # a bound for the failing case only: it ends at once when it works
    try:
        assert sweeping.cancelled(), "the sweep went on after its stop"
        assert len(connect.made) == 1 and connect.made[0].is_closed, "the connection made as it stopped was left open"
        assert not connect.made[0].subscribed and not sweeper.watching.is_set()
    finally:
        sweeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sweeping

"""A polling loop stopped (cancelled) in the very turn its nats-py request is answered stops: Python 3.11's
asyncio.wait_for inside nats-py would hand it the answer and drop the cancellation, and the loop would poll on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hearth.readmodels.runner import Projector
from hearth.readmodels.stream_identity import StreamIdentities


class _JetStreamAnsweringAsTheStopLands:
    """stream_info as nats-py's is on Python 3.11 when its answer and a cancellation land in the same turn: the first
    request returns its answer and the cancellation is gone; later ones are answered at once."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.waiting = asyncio.Event()

    async def stream_info(self, stream: str) -> SimpleNamespace:
        self.asked.append(stream)
        if len(self.asked) == 1:
            self.waiting.set()
            try:
                await asyncio.get_running_loop().create_future()  # the answer, on its way
            except asyncio.CancelledError:
                pass  # ... arrives in the turn the stop lands: wait_for returns it
        return SimpleNamespace(created=None, state=SimpleNamespace(last_seq=7))


async def test_the_projectors_lag_poll_stopped_as_the_broker_answers_stops():
    projector = object.__new__(Projector)  # only what the lag poll reads
    projector.streams = ("EVENTS_A", "EVENTS_B")
    projector._js = js = _JetStreamAnsweringAsTheStopLands()
    projector.positions = {stream: 0 for stream in projector.streams}
    projector.stream_last_seqs = {}
    projector._identities = StreamIdentities(projector.streams)
    projector._first_applied = asyncio.Event()

    polling = asyncio.create_task(projector._lag_loop())
    await js.waiting.wait()
    polling.cancel()
    await asyncio.wait({polling}, timeout=2.0)  # a bound for the failing case only: it ends at once when it works
    try:
        assert polling.cancelled(), "the lag poll went on after its stop"
        assert js.asked == ["EVENTS_A"]  # nothing asked after the stop
    finally:
        polling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await polling

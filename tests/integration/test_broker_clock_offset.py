"""A real nats-server says its time in a stream-info answer, so a process can measure its clock against the
broker's (hearth/events/broker_clock.py); on one machine the two agree."""

from __future__ import annotations

import pytest

from hearth.events.broker_clock import broker_clock_offset_s
from hearth.events.streams import SHARDS_STREAM, StreamSetup
from hearth.services.broker.connection import connect_nats

pytestmark = pytest.mark.integration


async def test_the_brokers_clock_is_read_from_a_stream_info_answer(nats_server):
    nc = await connect_nats(nats_server.url, name="clock-probe")
    try:
        await StreamSetup(create=True).ready(nc.jetstream(), (SHARDS_STREAM,))
        offset_s = await broker_clock_offset_s(nc, SHARDS_STREAM)
    finally:
        await nc.close()
    assert offset_s is not None and abs(offset_s) < 5

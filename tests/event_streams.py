"""Tests' JetStream context with the event streams made: one connection for a test, closed after it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.js import JetStreamContext

from hearth.events.streams import ensure_streams
from hearth.services.broker.connection import connect_nats


@contextlib.asynccontextmanager
async def jetstream_with_streams(nats_url: str, name: str) -> AsyncIterator[JetStreamContext]:
    """A JetStream context on a connection named `name`, the event streams ensured (as they are configured when
    entered: a test may shrink their duplicate window first)."""
    nc = await connect_nats(nats_url, name=name)
    try:
        jetstream = nc.jetstream()
        await ensure_streams(jetstream)
        yield jetstream
    finally:
        await nc.close()

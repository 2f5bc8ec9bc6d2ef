"""Opens the NATS client connection every hearth process uses: reconnect forever, log state changes."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NatsClient

log = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NATS_URL_ENV = "HEARTH_NATS_URL"
connect_timeout_s = 5.0
reconnect_wait_s = 0.5
# Payloads up to this size are buffered while disconnected, so a broker restart loses no publish.
pending_buffer_bytes = 64 * 1024 * 1024


def default_nats_url() -> str:
    return os.environ.get(NATS_URL_ENV, DEFAULT_NATS_URL)


async def connect_nats(
    url: str | None = None,
    *,
    name: str = "hearth",
    on_reconnected: Callable[[], Awaitable[None] | None] | None = None,
) -> NatsClient:
    """Connect with unlimited reconnects: a broker restart must never end a hearth process."""
    target = url or default_nats_url()

    async def disconnected() -> None:
        log.warning("%s: disconnected from NATS %s", name, target)

    async def reconnected() -> None:
        log.info("%s: reconnected to NATS %s", name, target)
        if on_reconnected is not None:
            result = on_reconnected()
            if result is not None:
                await result

    async def errored(error: Exception) -> None:
        log.warning("%s: NATS error: %s", name, error)

    return await nats.connect(
        servers=[target],
        name=name,
        connect_timeout=connect_timeout_s,
        reconnect_time_wait=reconnect_wait_s,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        pending_size=pending_buffer_bytes,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        error_cb=errored,
    )

"""The start/stop shape shared by the transport's subscribers (receiver, sender's ack side, ack observer).

`start()` subscribes once and flushes, so that whatever is published after it returns reaches the
subscription; every subscriber is also an async context manager that closes on exit.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Self

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hearth.services.common.config import TransportSettings
from hearth.services.broker.connection import flush_ordered

log = logging.getLogger(__name__)

_subscribe_timeout_s = TransportSettings().subscribe_timeout_s


class SubscribingEndpoint:
    """Base of a transport endpoint that lives on one NATS subscription (`_sub`, None until started)."""

    nc: NatsClient
    _sub: Subscription | None

    def _subscription(self) -> tuple[str, Callable[[Msg], Awaitable[None]]]:
        """The subject to subscribe to and the callback for its messages."""
        raise NotImplementedError

    def _start_flush_timeout_s(self) -> float:
        return _subscribe_timeout_s

    async def start(self) -> Self:
        if self._sub is None:
            subject, callback = self._subscription()
            self._sub = await self.nc.subscribe(subject, cb=callback)
            await flush_ordered(self.nc, self._start_flush_timeout_s())
        return self

    async def close(self) -> None:
        raise NotImplementedError

    async def _unsubscribe(self) -> None:
        """Drop the subscription (once); a connection that is closing may refuse, and the sub dies with it."""
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as error:
                log.debug("unsubscribe from %s failed: %s", sub.subject, error)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""Authenticated keepalives to a pipeline's hops: the orchestrator's one message on `hearth.keepalive.<pipeline_id>`
carries, for each hop it opened, a MAC made with a key derived from that hop's notice key, over a number that only
grows; a hop counts it as a sign of life only when its own MAC fits and the number is new (no replay)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from nats.aio.client import Client as NatsClient

from hearth.services.transport.headers import oversized_headers
from hearth.services.transport.mac import derived_key, message_mac

KEEPALIVE_KEY_LABEL = b"hearth keepalive v1"  # derived from a hop's notice key, like its ack witness key
HEADER_ALIVE_PREFIX = "Hearth-Alive-"  # then the hop's index: one MAC per hop in one message
# A keepalive's number in decimal: anything longer is not one.
max_keepalive_bytes = 20

T = TypeVar("T")


def keepalive_key(notice_key: bytes) -> bytes:
    """The key a hop's keepalives are MACed with: known to that hop and its orchestrator only."""
    return derived_key(notice_key, KEEPALIVE_KEY_LABEL)


def keepalive_message(number: int, keys_by_hop: Mapping[int, bytes]) -> tuple[bytes, dict[str, str]]:
    """The payload (`number`) and headers (a MAC per hop, with that hop's keepalive key) of one keepalive."""
    payload = str(number).encode()
    return payload, {f"{HEADER_ALIVE_PREFIX}{hop}": message_mac(key, {}, payload) for hop, key in keys_by_hop.items()}


def keepalive_number(data: bytes, headers: Mapping[str, str] | None, hop: int, key: bytes) -> int | None:
    """The keepalive's number when it carries this hop's MAC of it; None for any other message."""
    if len(data) > max_keepalive_bytes or not data.isdigit() or not headers or oversized_headers(headers):
        return None
    claimed = headers.get(f"{HEADER_ALIVE_PREFIX}{hop}")
    if claimed is None or not hmac.compare_digest(claimed.encode(), message_mac(key, {}, data).encode()):
        return None
    return int(data)


class KeepaliveSender:
    """An orchestrator's keepalives to the hops of one chain (the first at pipeline hop `first_hop`), numbered."""

    def __init__(self, first_hop: int, notice_keys: Sequence[bytes]) -> None:
        self._keys = {first_hop + index: keepalive_key(key) for index, key in enumerate(notice_keys)}
        self._sent = 0

    async def publish(self, nc: NatsClient, subject: str) -> None:
        """Publish the next keepalive on `subject`, numbered one above the last."""
        self._sent += 1
        payload, headers = keepalive_message(self._sent, self._keys)
        await nc.publish(subject, payload, headers=headers)


async def telling_while(pending: asyncio.Future[T], tell: Callable[[], Awaitable[None]], interval_s: float) -> T:
    """`pending`'s result, calling `tell` every `interval_s` while it is awaited and once when it is done (the hops
    opened meanwhile hear of their orchestrator from then on); `pending` is cancelled when the wait is."""
    try:
        while not (await asyncio.wait({pending}, timeout=interval_s))[0]:
            await tell()
        await tell()
        return pending.result()
    finally:
        pending.cancel()

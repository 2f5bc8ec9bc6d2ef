"""The last good answer on `llm.models`, which a call that names no `model` takes the mesh's default model from: asked
again once it is `[gateway] models_cache_s` old, and still used while asking again fails or times out, so that a busy
orchestrator does not fail calls the mesh would serve."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from hearth.protocol.discovery import ModelsReply
from hearth.services.gateway.errors import GatewayError

log = logging.getLogger(__name__)


class ModelListing:
    """The latest `llm.models` answer the gateway had, and when it had it."""

    def __init__(self, fresh_for_s: float) -> None:
        self.fresh_for_s = fresh_for_s
        self._reply: ModelsReply | None = None
        self._since = 0.0
        self._asking = 0  # calls asking again now

    def remember(self, reply: ModelsReply) -> None:
        """`reply` as the latest answer (every ask of the gateway's, GET /v1/models included, brings one)."""
        self._reply, self._since = reply, time.monotonic()

    async def recent(self, ask: Callable[[], Awaitable[ModelsReply]]) -> ModelsReply:
        """The latest answer while it is fresh; else `ask`'s, or the latest one still when `ask` fails (its
        GatewayError only when there is none) or another call is asking already (it need not wait for that)."""
        reply = self._reply
        if reply is not None and (time.monotonic() - self._since < self.fresh_for_s or self._asking):
            return reply
        self._asking += 1
        try:
            fresh = await ask()
        except GatewayError as error:
            if reply is None:
                raise
            log.info("llm.models: %s; using the answer of %.0f s ago", error, time.monotonic() - self._since)
            return reply
        finally:
            self._asking -= 1
        self.remember(fresh)
        return fresh

"""A chain whose open is cancelled (the client left, the call's deadline passed, a shutdown) while its hops have not
answered yet drops its subscriptions and tells the hops asked to close: the caller never got it, so nobody else
would."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.router import Hop


class _HopsThatDoNotAnswerYet:
    """A NATS client whose subscriptions are confirmed at once and whose control requests wait for ever."""

    max_payload = 1024 * 1024
    is_connected, is_closed = True, False
    pending_data_size = 0
    connected_url = None
    servers = ()

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.subscribed: list[str] = []
        self.unsubscribed: list[str] = []
        self.published: list[str] = []
        self.asked = asyncio.Event()
        self._inboxes = 0

    def new_inbox(self) -> str:
        self._inboxes += 1
        return f"_INBOX.test.{self._inboxes}"

    async def subscribe(self, subject: str, **kwargs) -> SimpleNamespace:
        self.subscribed.append(subject)

        async def unsubscribe() -> None:
            self.unsubscribed.append(subject)
        return SimpleNamespace(unsubscribe=unsubscribe, subject=subject)

    async def flush(self, timeout: float) -> None:
        pass

    async def publish(self, subject: str, payload: bytes = b"", **kwargs) -> None:
        self.published.append(subject)

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict | None = None):
        self.asked.set()
        await asyncio.Event().wait()


async def test_a_chain_cancelled_while_it_opens_unsubscribes_and_closes_its_hops():
    nc = _HopsThatDoNotAnswerYet()
    hops = [Hop("s0", "hearth.ctl.n0.s0", "n0", 0, 7)]
    chain = HopChain(nc, "p-cancelled", hops, node_id="orch", model_id="m", weights_sha256="w",
                     transport=TransportSettings())

    opening = asyncio.create_task(chain.open())
    await asyncio.wait_for(nc.asked.wait(), timeout=5)
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)

    assert opening.cancelled()
    assert nc.subscribed and sorted(nc.unsubscribed) == sorted(nc.subscribed)
    assert "hearth.ctl.n0.s0" in nc.published  # the hop's close

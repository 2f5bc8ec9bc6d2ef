"""Stand-ins that let an Orchestrator's request path run without a model: a catalog whose head is any object, every
prompt admitted as three tokens with room to spare, and a client that records what it is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

from hearth.services.orchestrator import call_serving


def admit_every_prompt(orchestrator, monkeypatch,
                       get_requested: Callable[[str], Awaitable[object]] | None = None) -> None:
    """Swap `orchestrator`'s catalog for one answering `get_requested` (default: any head at once), and admit every
    prompt as [1, 2, 3]."""

    async def any_head(name):
        return SimpleNamespace(context_length=None)

    async def admit_prompt(request, model):
        return [1, 2, 3]

    async def no_release():
        return None

    orchestrator.catalog.close()
    orchestrator.catalog = SimpleNamespace(get_requested=get_requested or any_head, release_freed_heap=no_release,
                                           close=lambda: None)
    monkeypatch.setattr(call_serving, "prompt_room", lambda request, model: None)
    monkeypatch.setattr(call_serving, "admit_prompt", admit_prompt)


class RecordingClient:
    """A call's client stream that keeps every frame sent to it (`sent`) and is always there to hear them."""

    def __init__(self) -> None:
        self.client_gone = asyncio.Event()
        self.sent: list = []

    async def send(self, frame) -> None:
        self.sent.append(frame)

    async def reachable(self, timeout_s: float) -> bool:
        return True

"""A call that names no `model` takes the mesh's default from a recent `llm.models` answer: a busy orchestrator whose
listing times out no longer fails a call it would serve (once an answer was had), while GET /v1/models asks afresh."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx2
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.errors import GatewayError, unavailable
from hearth.services.gateway.mesh import Gateway
from tests.unit.test_withdrawn_tokens import MODEL, ScriptedGateway, done, token

LISTING = ModelsReply(models=[ServedModel(id=MODEL, total_layers=2, complete=True)], default_model=MODEL)
MODELS_TIMEOUT_S = 0.1


class _Orchestrator:
    """Answers `llm.models` at once until it is `busy`; then answers nothing within a request's timeout."""

    def __init__(self) -> None:
        self.busy = False
        self.asked = 0

    async def request(self, subject, data, timeout):
        self.asked += 1
        if self.busy:
            await asyncio.sleep(timeout)
            raise NatsTimeoutError
        return SimpleNamespace(data=LISTING.model_dump_json().encode())


def _gateway(orchestrator: _Orchestrator, models_cache_s: float) -> Gateway:
    settings = HearthSettings(gateway={"models_timeout_s": MODELS_TIMEOUT_S, "models_cache_s": models_cache_s})
    return Gateway(SimpleNamespace(is_connected=True, request=orchestrator.request), settings, keyring=None)


async def test_a_busy_orchestrator_does_not_fail_a_call_without_model_once_a_listing_was_had():
    orchestrator = _Orchestrator()
    gateway = _gateway(orchestrator, models_cache_s=0)  # always asks again: only a failed ask falls back
    assert await gateway.default_model() == MODEL
    orchestrator.busy = True
    assert await gateway.default_model() == MODEL
    assert orchestrator.asked == 2
    with pytest.raises(GatewayError) as gone:  # the listing itself still asks afresh
        await gateway.models()
    assert (gone.value.status, gone.value.code) == (503, "orchestrator_gone")


async def test_with_no_listing_yet_a_busy_orchestrator_still_fails_the_call():
    orchestrator = _Orchestrator()
    orchestrator.busy = True
    with pytest.raises(GatewayError) as gone:
        await _gateway(orchestrator, models_cache_s=10).default_model()
    assert (gone.value.status, gone.value.code) == (503, "orchestrator_gone")


async def test_a_recent_listing_is_not_asked_again():
    orchestrator = _Orchestrator()
    gateway = _gateway(orchestrator, models_cache_s=60)
    await gateway.models()  # GET /v1/models' answer serves too
    assert [await gateway.default_model() for _ in range(3)] == [MODEL] * 3
    assert orchestrator.asked == 1


class _BusyListingGateway(ScriptedGateway):
    """Its first `llm.models` answer comes; every later one times out."""

    def __init__(self) -> None:
        super().__init__()
        self.listing.fresh_for_s = 0
        self.listed = 0

    async def models(self) -> ModelsReply:
        self.listed += 1
        if self.listed > 1:
            raise unavailable("orchestrator_gone", "no orchestrator answered llm.models within 5 s", 1.0)
        return await super().models()


async def test_a_call_without_model_is_served_while_the_listing_times_out():
    """Once, an orchestrator busy for about 6 s let the gateway's `llm.models` ask time out, and a call naming no
    model was answered 503 `orchestrator_gone` though the orchestrator would have served it."""
    scripted = _BusyListingGateway()
    transport = httpx2.ASGITransport(app=create_app(scripted))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        for _ in range(2):
            scripted.scripts.append([token(0, "ok"), done(1, 1)])
            response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == MODEL
        assert scripted.listed == 2
        assert (await http.get("/v1/models")).status_code == 503

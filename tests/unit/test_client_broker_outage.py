"""A call whose own broker connection is down (hearth/services/client/chat.py) waits that out for `[orchestrator]
broker_wait_s` in all, no longer: then it ends `pipeline_stalled`, which the gateway answers 503 with Retry-After (an
error event mid-stream); an outage shorter than that still gives the whole answer once the connection is back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx2
import openai
import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.protocol.chat_frames import ErrorFrame, TokenDeltaFrame
from hearth.services.client.chat import request_payload, stream_chat_raw
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.mesh import Gateway
from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import MODEL, done, token
from tests.unit.test_gateway_retry_hints import waits_as_named

pytestmark = pytest.mark.timeout(30)

silence_s = 0.02
broker_wait_s = 0.3
# Far beyond broker_wait_s: a call still waiting then waits without a bound.
hang_guard_s = 10.0


class OutageConnection:
    """A stand-in NATS connection whose inbox delivers `frames`, but whose link to the broker drops after
    `up_for_frames` of them and stays down for `down_for_waits` waits of the call (for good when None); once it is
    back (a reconnect counted) the rest arrive, from the first lost one, as the orchestrator sends them again."""

    def __init__(self, frames, *, up_for_frames: int, down_for_waits: int | None) -> None:
        self.frames = [frame.model_dump_json().encode() for frame in frames]
        self.up_for_frames = up_for_frames
        self.down_for_waits = down_for_waits
        self.is_connected = True
        self._drop_if_due()
        self.stats = {"reconnects": 0}
        self.published: list[bytes] = []

    def new_inbox(self) -> str:
        return "_INBOX.caller"

    async def subscribe(self, subject: str) -> SimpleNamespace:
        return SimpleNamespace(next_msg=self._next_msg, unsubscribe=self._unsubscribed)

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        self.published.append(payload)  # nats-py keeps a publish made while reconnecting for later

    async def _unsubscribed(self) -> None:
        return None

    def _drop_if_due(self) -> None:
        if self.up_for_frames == 0 and self.down_for_waits != 0:
            self.is_connected = False

    async def _next_msg(self, timeout: float) -> SimpleNamespace:
        if not self.is_connected:
            await asyncio.sleep(timeout)
            if self.down_for_waits is not None:
                self.down_for_waits -= 1
                if self.down_for_waits == 0:
                    self.is_connected = True
                    self.stats["reconnects"] += 1
            raise asyncio.TimeoutError()
        if not self.frames:
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError()
        self.up_for_frames -= 1
        self._drop_if_due()
        return SimpleNamespace(data=self.frames.pop(0), headers=None)


ANSWER = [token(0, "Hel"), token(1, "lo"), token(2, "!"), done(3, 3)]


async def frames_of(connection: OutageConnection, **timeouts: float) -> list:
    payload = request_payload(ChatRequest(prompt="hi"))
    options = {"first_frame_timeout": silence_s, "frame_gap_timeout": silence_s, "broker_wait": broker_wait_s,
               **timeouts}

    async def collect() -> list:
        return [frame async for frame in stream_chat_raw(connection, payload, **options)]

    return await asyncio.wait_for(collect(), timeout=hang_guard_s)


async def test_a_connection_that_stays_down_ends_the_call_pipeline_stalled_after_broker_wait_s():
    """It waited without any bound: the call (and an HTTP client behind a gateway) got nothing until the broker
    came back, however long that took."""
    frames = await frames_of(OutageConnection(ANSWER, up_for_frames=1, down_for_waits=None))
    assert [frame.type for frame in frames] == ["token_delta", "error"]
    assert isinstance(frames[-1], ErrorFrame) and frames[-1].code == "pipeline_stalled"
    assert "broker_wait_s" in frames[-1].message and frames[-1].seq == 1


async def test_a_connection_down_before_the_first_frame_is_bounded_as_well():
    frames = await frames_of(OutageConnection(ANSWER, up_for_frames=0, down_for_waits=None),
                             first_frame_timeout=hang_guard_s)
    assert [(frame.type, frame.code) for frame in frames] == [("error", "pipeline_stalled")]


async def test_a_short_outage_still_gives_the_whole_answer():
    frames = await frames_of(OutageConnection(ANSWER, up_for_frames=2, down_for_waits=3), broker_wait=hang_guard_s)
    assert [frame.type for frame in frames] == ["token_delta"] * 3 + ["done"]
    assert "".join(frame.text for frame in frames if isinstance(frame, TokenDeltaFrame)) == "Hello!"


async def test_silence_while_connected_is_still_the_orchestrator_gone():
    frames = await frames_of(OutageConnection(ANSWER[:2], up_for_frames=2, down_for_waits=0))
    assert [(frame.type, getattr(frame, "code", None)) for frame in frames][-1] == ("error", "orchestrator_gone")


class OutageGateway(Gateway):
    """A gateway over an OutageConnection, its model list answered without the mesh."""

    async def models(self) -> ModelsReply:
        self._known_models = {MODEL}
        return ModelsReply(models=[ServedModel(id=MODEL, total_layers=2, complete=True)], default_model=MODEL)


def gateway_app(connection: OutageConnection):
    settings = HearthSettings(orchestrator={"broker_wait_s": broker_wait_s},
                              client={"first_frame_timeout_s": silence_s, "silence_timeout_s": silence_s})
    return create_app(OutageGateway(connection, settings, keyring=None))


async def test_the_gateway_answers_503_with_retry_after_when_its_connection_stays_down_before_a_token():
    app = gateway_app(OutageConnection(ANSWER, up_for_frames=0, down_for_waits=None))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway") as http:
        response = await asyncio.wait_for(http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}), timeout=hang_guard_s)
    assert (response.status_code, response.json()["error"]["code"]) == (503, "pipeline_stalled")
    assert waits_as_named(response.headers, 1.0), response.headers  # 1 s, spread as every refusal's wait is


async def test_a_stream_whose_gateway_connection_stays_down_ends_with_an_error_event():
    app = gateway_app(OutageConnection(ANSWER, up_for_frames=1, down_for_waits=None))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway") as http:
        stream = await openai_client(http).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="broker_wait_s"):
            async with asyncio.timeout(hang_guard_s):
                async for chunk in stream:
                    texts.append(chunk.choices[0].delta.content or "")
    assert "".join(texts) == "Hel"

"""The gateway stopping (a real uvicorn on the loopback, as `hearth gateway` stops it) while calls are open: a call
that ends within `[gateway] shutdown_grace_s` is answered whole, and one still open after it gets an OpenAI answer
the client can act on (503 `gateway_stopping` with Retry-After, or that error event mid-stream), not uvicorn's
plain-text 500 or a stream cut short. Until then its server sleeps: it does not wake ten times a second to look for
the stop, as uvicorn's own main loop does."""

from __future__ import annotations

import asyncio
import time
from email.utils import parsedate_to_datetime
import socket

import httpx2
import openai
import pytest

from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.http_server import GatewayHttpServer, server_config, stop_serving
from tests.unit.test_gateway_hardening import CLOSE_WAIT_S, gateway_with, get, serving
from tests.unit.test_withdrawn_tokens import MODEL, ScriptedCall, ScriptedGateway, done, token
from tests.unit.test_gateway_retry_hints import waits_as_named

GRACE_S = 1.0
MESSAGES = [{"role": "user", "content": "hi"}]


class HeldGateway(ScriptedGateway):
    """Each call sends `max_tokens` - 1 tokens, then its done frame once `release` is set when `max_tokens` is 3, and
    nothing more otherwise; `closed` counts the calls whose frames were closed."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = HearthSettings(gateway={"shutdown_grace_s": GRACE_S})
        self.release = asyncio.Event()
        self.closed = 0

    def call(self, request, caller):
        gateway = self

        async def frames():
            try:
                for seq in range(request.max_tokens - 1):
                    yield token(seq, "x")
                await (gateway.release.wait() if request.max_tokens == 3 else asyncio.Event().wait())
                yield done(request.max_tokens, request.max_tokens - 1)
            finally:
                gateway.closed += 1

        held = ScriptedCall(request, [])
        held._frames = frames()
        return held


async def asked(client: openai.AsyncOpenAI, *, max_tokens: int, stream: bool):
    """What the client ends with: the answer's text, or the error it raised."""
    try:
        answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                                      stream=stream)
        if not stream:
            return answer.choices[0].message.content
        return "".join([chunk.choices[0].delta.content or "" async for chunk in answer if chunk.choices])
    except openai.APIError as error:
        return error


async def test_calls_open_past_the_grace_are_answered_503_gateway_stopping_and_a_stream_ends_with_its_event():
    gateway = HeldGateway()
    sock = socket.create_server(("127.0.0.1", 0))
    server = GatewayHttpServer(server_config(create_app(gateway), gateway.settings.gateway))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()
        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0)
        # Mid-stream, waiting for a first token (whole and streamed), and one that ends within the grace.
        calls = [asyncio.create_task(asked(client, max_tokens=max_tokens, stream=stream))
                 for max_tokens, stream in ((2, True), (1, False), (1, True), (3, False))]
        while gateway.open_calls < len(calls):
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(stop_serving(server, serving, GRACE_S, gateway.stops.stop))
        gateway.release.set()  # the last call ends within the grace: it is answered whole
        streamed, waiting, waiting_streamed, whole = await asyncio.wait_for(asyncio.gather(*calls), CLOSE_WAIT_S)
        await asyncio.wait_for(stopping, CLOSE_WAIT_S)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, CLOSE_WAIT_S)
        sock.close()
    assert whole == "xx"
    assert isinstance(streamed, openai.APIError) and not isinstance(streamed, openai.APIStatusError), streamed
    assert streamed.code == "gateway_stopping"
    for refused in (waiting, waiting_streamed):
        assert isinstance(refused, openai.InternalServerError), refused
        assert (refused.status_code, refused.code) == (503, "gateway_stopping")
        assert waits_as_named(refused.response.headers, 1)
    assert gateway.open_calls == 0 and gateway.closed == len(calls)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_a_call_after_the_stop_is_answered_503_at_once(path):
    gateway = HeldGateway()
    gateway.stops.stop()
    transport = httpx2.ASGITransport(app=create_app(gateway))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        response = await (http.post(path, json={"model": MODEL, "messages": MESSAGES}) if "chat" in path
                          else http.get(path))
    assert (response.status_code, response.json()["error"]["code"]) == (503, "gateway_stopping")
    assert waits_as_named(response.headers, 1) and not gateway.received


async def test_the_http_server_does_not_tick_while_idle_and_dates_each_answer_when_it_comes():
    """uvicorn's main loop wakes every 0.1 s (on_tick) to look for a stop and renew the Date header; the gateway's
    waits for the stop, and each answer is still dated by the second its request came in."""
    servers: list = []
    ticks: list[int] = []
    async with serving(gateway_with(), servers) as address:
        async def counted_tick(counter: int) -> bool:
            ticks.append(counter)
            return False

        servers[0].on_tick = counted_tick
        _, headers = await asyncio.to_thread(get, address, "/healthz")
        first = parsedate_to_datetime(headers["date"])
        while int(time.time()) <= first.timestamp():  # the next second
            await asyncio.sleep(0.05)
        _, headers = await asyncio.to_thread(get, address, "/healthz")
        assert parsedate_to_datetime(headers["date"]) > first
        assert abs(parsedate_to_datetime(headers["date"]).timestamp() - time.time()) < 60
    assert ticks == []

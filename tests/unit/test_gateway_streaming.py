"""The gateway's streams as OpenAI's own client reads them, over scripted frame streams without a network: a
streamed answer says what the whole answer says, and a refusal the client may send again says when."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx2
import pytest
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from hearth.protocol.chat_frames import ErrorFrame, PipelineAbortedFrame
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.errors import GatewayError
from hearth.services.gateway.mesh import Gateway
from tests.unit.test_gateway_openai_conformance import BrokerClosedGateway, openai_client
from tests.unit.test_gateway_retry_hints import waits_as_named
from tests.unit.test_withdrawn_tokens import (  # noqa: F401 (gateway is a fixture)
    MODEL, ScriptedGateway, chat_body, done, events_of, failover, gateway, token, withdrawn,
)

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


async def streamed_and_whole(http, scripted, frames, **fields) -> tuple[str, str | None]:
    """The content `frames` make streamed (as OpenAI's client puts it together) and whole."""
    client = openai_client(http)
    messages = [{"role": "user", "content": "hi"}]
    scripted.scripts.append(list(frames))
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True, **fields)
    streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    scripted.scripts.append(list(frames))
    whole = await client.chat.completions.create(model=MODEL, messages=messages, **fields)
    return streamed, whole.choices[0].message.content


@pytest.mark.parametrize("first", [" {", "\n{", " "])
async def test_a_text_answer_of_a_call_that_may_call_tools_streams_its_text_even_when_it_opens_with_a_blank(
        gateway, first):
    """With `tools` (`tool_choice` auto) an answer is a call only when it opens with "{" itself: the orchestrator's
    grammar lets a text answer open with anything else, a blank too, and then "{" may follow. Such a text was held
    back as a call in the making and never sent: the stream ended `stop` with no content at all."""
    http, scripted = gateway
    frames = [token(0, first), token(1, "a"), token(2, "}"), done(3, 3)]
    streamed, whole = await streamed_and_whole(http, scripted, frames, tools=[LOOKUP])
    assert streamed == whole == first + "a}"


async def test_a_tool_call_still_streams_as_fragments(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, '{"name":"lookup",'), token(1, '"arguments":{"q":1}}'),
                             done(2, 2).model_copy(update={"finish_reason": "tool_calls"})])
    stream = await openai_client(http).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[LOOKUP], stream=True)
    chunks = [chunk async for chunk in stream]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "lookup" and "".join(call.function.arguments for call in calls) == '{"q":1}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_a_stream_s_usage_leaves_withdrawn_tokens_out_as_the_whole_answer_s_does(gateway):
    """A withdrawal of tokens no chunk carried leaves the stream whole; its usage chunk counted them all the same
    (the orchestrator's count), where the whole answer counts the tokens that stand."""
    http, scripted = gateway
    frames = [token(0, "Hel"), token(1, "lo"), token(2, ""), withdrawn(3, 2), failover(4, 2), token(5, "!"),
              done(6, 4)]
    client = openai_client(http)
    usages = []
    for stream in (True, False):
        scripted.scripts.append(list(frames))
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = [chunk async for chunk in answer]
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            answer = chunks[-1]
        usages.append(answer.usage.completion_tokens)
    assert usages == [3, 3]
    scripted.scripts.append(list(frames))
    events = events_of(await scripted_completion(http, stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 3


async def scripted_completion(http, **fields):
    return await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **fields})


@pytest.mark.parametrize("final", [
    ErrorFrame(seq=1, code="shard_unavailable", message="no live shards cover layers 0-1"),
    PipelineAbortedFrame(seq=1, code="pipeline_stalled", reason="broker gone"),
    ErrorFrame(seq=1, code="orchestrator_gone", message="silent"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_503_says_when_to_try_again(gateway, final, stream):
    """Retry-After goes with a 503 as with a 429 ([gateway] retry_after_s): the mesh cannot serve the call now."""
    http, scripted = gateway
    scripted.scripts.append([final])
    response = await http.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert response.status_code == 503 and waits_as_named(response.headers, 1)
    assert response.json()["error"]["code"] == final.code


async def test_a_503_of_the_gateway_s_own_broker_connection_or_of_the_model_list_says_when_to_try_again():
    class SilentCatalogGateway(ScriptedGateway):
        async def models(self):
            raise ConnectionClosedError

    for scripted, path in ((BrokerClosedGateway(tokens=0), "/v1/chat/completions"),
                           (SilentCatalogGateway(), "/v1/models")):
        transport = httpx2.ASGITransport(app=create_app(scripted), raise_app_exceptions=False)
        async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
            response = await (http.post(path, json=chat_body()) if path.endswith("completions") else http.get(path))
        assert response.status_code == 503 and waits_as_named(response.headers, 1), path
        assert response.json()["error"]["code"] == "nats_disconnected"


@pytest.mark.parametrize("failure", [NoRespondersError, NatsTimeoutError])
async def test_a_model_list_no_orchestrator_answers_says_when_to_try_again(failure):
    async def request(subject, data, timeout):
        raise failure

    gateway = Gateway(SimpleNamespace(is_connected=True, request=request), HearthSettings(), keyring=None)
    with pytest.raises(GatewayError) as refused:
        await gateway.models()
    response = refused.value.response()
    assert response.status_code == 503 and waits_as_named(response.headers, 1)

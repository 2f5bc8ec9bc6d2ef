"""The gateway's streams as OpenAI's own client reads them, over scripted frame streams without a network: a
streamed answer says what the whole answer says."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import (  # noqa: F401 (gateway is a fixture)
    MODEL, done, events_of, failover, gateway, token, withdrawn,
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

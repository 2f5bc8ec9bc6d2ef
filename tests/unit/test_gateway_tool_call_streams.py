"""A chat answer that may call tools says the same streamed as whole, as OpenAI's client puts a stream together
(ChatCompletionStreamState, which its `chat.completions.stream` helper uses): a tool call's message has `content`
null either way, and a call cut by `max_tokens` (finish_reason `length`) is the call as far as it came once its
arguments began (as OpenAI's are: arguments cut short, finish_reason `length`), and its text before that."""

from __future__ import annotations

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_gateway_streaming import LOOKUP
from tests.unit.test_withdrawn_tokens import MODEL, done, gateway, token  # noqa: F401 (gateway is a fixture)

MESSAGES = [{"role": "user", "content": "hi"}]


def ended(seq: int, tokens: int, reason: str):
    return done(seq, tokens).model_copy(update={"finish_reason": reason})


async def streamed_and_whole(http, scripted, frames):
    """The message and finish reason `frames` make streamed (as OpenAI's client accumulates it) and whole."""
    client = openai_client(http)
    scripted.scripts.append(list(frames))
    # The snapshot: its final completion raises on finish_reason `length` rather than give the message.
    state = ChatCompletionStreamState()
    async for chunk in await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[LOOKUP],
                                                            stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    scripted.scripts.append(list(frames))
    whole = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[LOOKUP])).choices[0]
    return streamed, whole


def call_of(choice) -> tuple | None:
    calls = choice.message.tool_calls
    return None if not calls else (len(calls), calls[0].function.name, calls[0].function.arguments)


async def test_a_streamed_tool_call_s_content_is_null_as_the_whole_answer_s(gateway):
    """Its opening chunk had `content: ""`, so the stream made `''` where the whole answer has null."""
    http, scripted = gateway
    frames = [token(0, '{"name":"lookup",'), token(1, '"arguments":{"q":1}}'), ended(2, 2, "tool_calls")]
    streamed, whole = await streamed_and_whole(http, scripted, frames)
    assert streamed.message.content is None and whole.message.content is None
    assert call_of(streamed)[:2] == call_of(whole)[:2] == (1, "lookup")
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"


async def test_a_text_answer_that_may_call_tools_still_opens_with_empty_content(gateway):
    http, scripted = gateway
    client = openai_client(http)
    scripted.scripts.append([token(0, "Hi"), token(1, " there"), done(2, 2)])
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[LOOKUP], stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Hi there"


@pytest.mark.parametrize("cut_after", ['{"name":"look', '{"name":"lookup",', '{"name":"lookup","argu'])
async def test_a_call_cut_before_its_arguments_is_its_text_streamed_as_whole(gateway, cut_after):
    """It streamed nothing at all (the call was held back until its arguments, which never came), where the whole
    answer gave the text."""
    http, scripted = gateway
    frames = [token(0, cut_after), ended(1, 1, "length")]
    streamed, whole = await streamed_and_whole(http, scripted, frames)
    assert streamed.message.content == whole.message.content == cut_after
    assert call_of(streamed) is None and call_of(whole) is None
    assert streamed.finish_reason == whole.finish_reason == "length"


async def test_a_call_cut_in_its_arguments_is_the_cut_call_whole_as_streamed(gateway):
    """Streamed, its name and the arguments so far went out as they came (no chunk is taken back); the whole
    answer gave the text instead."""
    http, scripted = gateway
    frames = [token(0, '{"name":"lookup",'), token(1, '"arguments":{"q":'), token(2, '"wea'), ended(3, 3, "length")]
    streamed, whole = await streamed_and_whole(http, scripted, frames)
    assert call_of(streamed) == call_of(whole) == (1, "lookup", '{"q":"wea')
    assert streamed.message.content is None and whole.message.content is None
    assert streamed.finish_reason == whole.finish_reason == "length"

"""Structured output through a real mesh (nats-server, three shard hosts of the random-weight tiny model, an
orchestrator, `hearth gateway`) read by the `openai` client: json_schema answers validate in every call, a cut one
ends `length`, a tool call comes whole and streamed as OpenAI's, a history with tool calls is accepted, and a schema
hearth cannot follow is refused naming the field; and LangChain's ChatOpenAI (langchain-openai, a second client
library) drives the same gateway: a multi-turn chat, a streamed answer, a tool call, JSON output."""

from __future__ import annotations

import json

import openai
import pytest

from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
CALLS = 10
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10}, "count": {"type": "integer"},
                         "level": {"enum": ["low", "high"]}},
          "required": ["name", "count", "level"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "what is the weather"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_models_dir):
    """The gateway's API base URL and an API key of member alice."""
    with three_shard_mesh(tmp_path_factory.mktemp("structured"), tiny_models_dir) as cluster:
        key = create_api_key(cluster.member_key("alice", "client").parents[1], "alice")
        yield f"{cluster.start_gateway().ready_file.read_text()}/v1", key


@pytest.fixture(scope="module")
def client(gateway):
    base_url, key = gateway
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def assert_valid(answer: dict) -> None:
    assert set(answer) == {"name", "count", "level"}
    assert isinstance(answer["name"], str) and len(answer["name"]) <= 10
    assert isinstance(answer["count"], int) and answer["level"] in {"low", "high"}


def test_json_schema_answers_of_a_random_model_validate_in_every_call(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for seed in range(CALLS):
        answer = client.chat.completions.create(model=TINY_MODEL_NAME, messages=MESSAGES, temperature=1.0,
                                                seed=seed, max_tokens=300, response_format=response_format)
        assert answer.choices[0].finish_reason == "stop"
        assert_valid(json.loads(answer.choices[0].message.content))
    streamed = list(client.chat.completions.create(model=TINY_MODEL_NAME, messages=MESSAGES, max_tokens=300,
                                                   seed=0, response_format=response_format, stream=True))
    assert_valid(json.loads("".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)))
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_an_answer_max_tokens_cuts_ends_length_with_its_json_unfinished(client):
    answer = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=MESSAGES, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(answer.choices[0].message.content)


def test_a_tool_call_whole_and_streamed(client):
    asked = dict(model=TINY_MODEL_NAME, messages=MESSAGES, max_tokens=300, seed=1, tools=[WEATHER],
                 tool_choice="required")
    answer = client.chat.completions.create(**asked)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in {"Paris", "Oslo"} and isinstance(arguments["days"], int)

    chunks = list(client.chat.completions.create(**asked, stream=True))
    fragments = [fragment for chunk in chunks if chunk.choices for fragment in chunk.choices[0].delta.tool_calls or []]
    assert fragments[0].id.startswith("call_") and fragments[0].function.name == "get_weather"
    assert all(fragment.index == 0 for fragment in fragments)
    assert json.loads("".join(fragment.function.arguments or "" for fragment in fragments)) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_history_with_a_tool_call_and_its_result_is_answered(client):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # Seeded: an unseeded sample of the toy model may end in its end-of-text token within four tokens.
    answer = client.chat.completions.create(model=TINY_MODEL_NAME, messages=history, max_tokens=4, seed=1,
                                            tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content is not None


def test_a_schema_hearth_cannot_follow_is_refused_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        client.chat.completions.create(model=TINY_MODEL_NAME, messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=TINY_MODEL_NAME, messages=MESSAGES, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}])


def test_langchain_chat_openai_chats_streams_calls_a_tool_and_answers_json(gateway):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    base_url, key = gateway

    def model(max_tokens: int):
        return langchain_openai.ChatOpenAI(model=TINY_MODEL_NAME, base_url=base_url, api_key=key, temperature=0,
                                           max_tokens=max_tokens, max_retries=0)

    turns = [SystemMessage("be brief"), HumanMessage("the quick brown fox"), AIMessage("jumps"),
             HumanMessage("over the lazy dog")]
    reply = model(6).invoke(turns)
    assert reply.content and reply.response_metadata["finish_reason"] == "length"
    streamed = "".join(chunk.content for chunk in model(6).stream(turns))
    assert streamed == reply.content

    called = model(300).bind_tools([WEATHER], tool_choice="get_weather").invoke("what is the weather")
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in {"Paris", "Oslo"}

    answer = model(300).with_structured_output({"title": "thing", **SCHEMA}, method="json_schema").invoke("a thing")
    assert_valid(answer)

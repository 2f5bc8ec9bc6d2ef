"""The gateway as OpenAI's official Python client meets it, over scripted frame streams without a network: what the
client reads from an answer or an error (`code`, `type`, `param`, the request id) is what OpenAI's API gives."""

from __future__ import annotations

import inspect

import openai
import pytest
from openai.types.chat import (
    ChatCompletionAllowedToolChoiceParam, ChatCompletionAssistantMessageParam, ChatCompletionContentPartImageParam,
    ChatCompletionContentPartInputAudioParam, ChatCompletionContentPartRefusalParam,
    ChatCompletionContentPartTextParam, ChatCompletionCustomToolParam, ChatCompletionDeveloperMessageParam,
    ChatCompletionFunctionMessageParam, ChatCompletionFunctionToolParam, ChatCompletionMessageCustomToolCallParam,
    ChatCompletionMessageFunctionToolCallParam, ChatCompletionNamedToolChoiceCustomParam,
    ChatCompletionNamedToolChoiceParam, ChatCompletionPredictionContentParam, ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam, ChatCompletionToolMessageParam, ChatCompletionUserMessageParam,
    chat_completion_content_part_param, chat_completion_content_part_text_param,
    chat_completion_message_function_tool_call_param, chat_completion_named_tool_choice_param,
    completion_create_params,
)
from openai.types.shared_params import FunctionDefinition, ResponseFormatJSONSchema, response_format_json_schema

from hearth.protocol.chat_frames import ErrorFrame
from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import MODEL, done, gateway, token  # noqa: F401 (gateway is a fixture)

HI = [{"role": "user", "content": "hi"}]
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [LOOKUP], "response_format": {"type": "json_object"}}, "response_format"),
])
async def test_fields_that_disagree_are_refused_naming_the_field_in_plain_words(gateway, fields, param):
    """A rule between fields used to be refused with `param` null and pydantic's "Value error, " before its words."""
    http, scripted = gateway
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(http).chat.completions.create(model=MODEL, messages=HI, **fields)
    assert (refused.value.code, refused.value.param) == ("bad_request", param), refused.value.body
    assert "Value error" not in refused.value.message and f"'{param}'" in refused.value.message, refused.value.message
    assert not scripted.received


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": HI}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
])
@pytest.mark.parametrize("unknown", ["max_token", "min_p"])
async def test_a_field_openai_does_not_know_is_refused_naming_it_as_openai_refuses_it(gateway, path, body, unknown):
    """A misspelt field (`max_token`) or another server's extension (vLLM's `min_p`) used to be accepted and change
    nothing: the answer then silently ran to hearth's default length, or sampled as the client did not ask."""
    http, scripted = gateway
    response = await http.post(path, json={**body, unknown: 5})
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["type"], error["code"]) == (
        400, unknown, "invalid_request_error", "unknown_parameter"), error
    assert error["message"].startswith(f"Unrecognized request argument supplied: {unknown}"), error
    assert not scripted.received


async def test_a_field_name_of_any_length_is_refused_in_a_short_answer(gateway):
    http, _ = gateway
    response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "x" * 100_000: 1,
                                                             **{f"k{i}": 1 for i in range(1000)}})
    error = response.json()["error"]
    assert response.status_code == 400 and len(error["message"]) < 1_000 and error["param"] is None, error


def _client_fields(create) -> set[str]:
    return {name for name in inspect.signature(create).parameters
            if name not in ("self", "timeout") and not name.startswith("extra_")}


@pytest.mark.parametrize("create, body", [
    (openai.resources.chat.completions.Completions.create, {"model": MODEL, "messages": HI}),
    (openai.resources.completions.Completions.create, {"model": MODEL, "prompt": "hi"}),
])
async def test_every_field_openai_s_client_sends_is_known_to_the_gateway(gateway, create, body):
    """Each field of the pinned client's `create` is honoured, refused by name as one hearth cannot honour, or
    accepted as one that changes nothing: never refused as unknown."""
    http, scripted = gateway
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for name in sorted(_client_fields(create) - set(body)):
        scripted.scripts.append([token(0, "ok"), done(1, 1)])
        response = await http.post(path, json={**body, name: None})
        assert response.status_code == 200, (name, response.text)
        scripted.scripts.clear()


async def test_moderation_which_hearth_does_not_run_is_refused_by_name(gateway):
    http, scripted = gateway
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(http).chat.completions.create(model=MODEL, messages=HI,
                                                          moderation={"model": "omni-moderation-latest"})
    assert refused.value.param == "moderation" and not scripted.received


async def test_openai_s_fields_that_change_nothing_are_accepted(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    answer = await openai_client(http).chat.completions.create(
        model=MODEL, messages=HI, user="u", metadata={"a": "b"}, store=False, service_tier="auto",
        parallel_tool_calls=False, reasoning_effort="low", prediction={"type": "content", "content": "x"},
        prompt_cache_key="k", safety_identifier="s", verbosity="low")
    assert answer.choices[0].message.content == "ok"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_carries_its_request_id_where_openai_s_client_reads_it(gateway, stream):
    """openai-python reads `x-request-id` into `completion._request_id` (and an error's `request_id`): the id the
    call went to the mesh with, which the orchestrator's log and events name."""
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    raw = await openai_client(http).chat.completions.with_raw_response.create(model=MODEL, messages=HI,
                                                                                stream=stream)
    assert raw.headers.get("x-request-id") == scripted.received[-1].request_id
    scripted.scripts.append([ErrorFrame(seq=0, code="bad_request", message="field 'messages': no")])
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(http).completions.create(model=MODEL, prompt="hi", stream=stream)
    assert refused.value.request_id == scripted.received[-1].request_id


async def test_a_refusal_no_retry_can_change_tells_openai_s_client_not_to_retry(gateway):
    """openai-python retries every 5xx (twice by default): `experimental_disabled` (the operator turned the mesh's
    serving off) would be asked three times for the same answer."""
    http, scripted = gateway
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=2)
    scripted.scripts += [[ErrorFrame(seq=0, code="experimental_disabled", message="off")] for _ in range(3)]
    with pytest.raises(openai.InternalServerError) as refused:
        await client.chat.completions.create(model=MODEL, messages=HI)
    assert refused.value.code == "experimental_disabled" and len(scripted.received) == 1


# One object of each kind the pinned client's `create` may send inside a chat body, every key its type declares set
# (to null where hearth refuses any other value), with that type; those hearth honours or that change nothing here.
CACHE_BREAKPOINT = {"mode": "explicit", "ttl": "30m"}
TEXT_PART = {"type": "text", "text": "a", "prompt_cache_breakpoint": CACHE_BREAKPOINT}
REFUSAL_PART = {"type": "refusal", "refusal": "no"}
CALLED = {"name": "lookup", "arguments": "{}"}
TOOL_CALL = {"id": "call_1", "type": "function", "function": CALLED}
ASSISTANT = {"role": "assistant", "content": [TEXT_PART, REFUSAL_PART], "name": "bot", "refusal": None,
             "audio": None, "function_call": None, "tool_calls": [TOOL_CALL]}
FUNCTION = {"name": "lookup", "description": "looks up", "parameters": {"type": "object"}, "strict": True}
NAMED_FUNCTION = {"name": "lookup"}
JSON_SCHEMA = {"name": "r", "description": "an answer", "schema": {"type": "object"}, "strict": True}
HISTORY = [{"role": "system", "content": [TEXT_PART], "name": "rules"},
           {"role": "developer", "content": [TEXT_PART], "name": "dev"},
           {"role": "user", "content": [TEXT_PART], "name": "alice"}, ASSISTANT,
           {"role": "tool", "content": [TEXT_PART], "tool_call_id": "call_1"}]
TOOLS = {"tools": [{"type": "function", "function": FUNCTION}],
         "tool_choice": {"type": "function", "function": NAMED_FUNCTION}}
OTHERS = {"response_format": {"type": "json_schema", "json_schema": JSON_SCHEMA},
          "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True,
          "prediction": {"type": "content", "content": [TEXT_PART]},
          "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}
HONOURED = [
    (chat_completion_content_part_text_param.PromptCacheBreakpoint, CACHE_BREAKPOINT),
    (ChatCompletionContentPartTextParam, TEXT_PART), (ChatCompletionContentPartRefusalParam, REFUSAL_PART),
    (ChatCompletionSystemMessageParam, HISTORY[0]), (ChatCompletionDeveloperMessageParam, HISTORY[1]),
    (ChatCompletionUserMessageParam, HISTORY[2]), (ChatCompletionAssistantMessageParam, ASSISTANT),
    (ChatCompletionToolMessageParam, HISTORY[4]), (ChatCompletionMessageFunctionToolCallParam, TOOL_CALL),
    (chat_completion_message_function_tool_call_param.Function, CALLED),
    (ChatCompletionFunctionToolParam, TOOLS["tools"][0]), (FunctionDefinition, FUNCTION),
    (ChatCompletionNamedToolChoiceParam, TOOLS["tool_choice"]),
    (chat_completion_named_tool_choice_param.Function, NAMED_FUNCTION),
    (ResponseFormatJSONSchema, OTHERS["response_format"]), (response_format_json_schema.JSONSchema, JSON_SCHEMA),
    (ChatCompletionStreamOptionsParam, OTHERS["stream_options"]),
    (ChatCompletionPredictionContentParam, OTHERS["prediction"]),
    (completion_create_params.PromptCacheOptions, OTHERS["prompt_cache_options"]),
]
# And those hearth cannot honour: each refused by name (what it carries inside is not read).
REFUSED = [
    (ChatCompletionContentPartImageParam, "messages", {"type": "image_url", "image_url": {"url": "https://x/y.png"},
                                                       "prompt_cache_breakpoint": CACHE_BREAKPOINT}),
    (ChatCompletionContentPartInputAudioParam, "messages", {"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "wav"}, "prompt_cache_breakpoint": CACHE_BREAKPOINT}),
    (chat_completion_content_part_param.File, "messages", {"type": "file", "file": {"file_id": "file-1"},
                                                           "prompt_cache_breakpoint": CACHE_BREAKPOINT}),
    (ChatCompletionFunctionMessageParam, "messages", {"role": "function", "name": "lookup", "content": "42"}),
    (ChatCompletionMessageCustomToolCallParam, "messages", {"id": "c", "type": "custom", "custom": {"name": "shell",
                                                                                                  "input": "ls"}}),
    (ChatCompletionCustomToolParam, "tools", {"type": "custom", "custom": {"name": "shell"}}),
    (ChatCompletionAllowedToolChoiceParam, "tool_choice", {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": TOOLS["tools"]}}),
    (ChatCompletionNamedToolChoiceCustomParam, "tool_choice", {"type": "custom", "custom": {"name": "shell"}}),
]


def _keys(typed_dict) -> frozenset[str]:
    return typed_dict.__required_keys__ | typed_dict.__optional_keys__


@pytest.mark.parametrize("typed_dict, example", HONOURED, ids=lambda value: getattr(value, "__qualname__", ""))
def test_each_object_the_gateway_is_sent_below_sets_every_key_of_the_client_s_type(typed_dict, example):
    """So that a key the pinned client adds fails here until the gateway declares it."""
    assert set(example) == _keys(typed_dict)


async def test_every_key_of_every_object_openai_s_client_sends_is_known_to_the_gateway(gateway):
    """Each key of the objects the pinned client may send inside a body is accepted, never refused as unknown: a
    history of every kind of message (each of every kind of part hearth reads), tools and a named tool choice, and
    the other objects, each with every key of its type."""
    http, scripted = gateway
    for fields in (TOOLS, OTHERS):
        scripted.scripts.append([token(0, "{}"), done(1, 1)])
        response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HISTORY, **fields})
        assert response.status_code == 200, response.text
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True,
                                                        "stream_options": OTHERS["stream_options"]})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("typed_dict, param, example", REFUSED, ids=lambda value: getattr(value, "__qualname__", ""))
async def test_every_object_openai_s_client_sends_that_hearth_cannot_honour_is_refused_by_name(
        gateway, typed_dict, param, example):
    assert set(example) == _keys(typed_dict)
    http, scripted = gateway
    if "role" in example:
        fields = {"messages": [example, HI[0]]}
    elif "image_url" in example or "input_audio" in example or "file" in example:
        fields = {"messages": [{"role": "user", "content": [example]}]}
    elif "id" in example:
        fields = {"messages": [{"role": "assistant", "tool_calls": [example]}, HI[0]]}
    elif param == "tools":
        fields = {"tools": [example]}
    else:
        fields = {"tools": TOOLS["tools"], "tool_choice": example}
    response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **fields})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, "bad_request", param), error
    assert "not supported by hearth" in error["message"] and not scripted.received

"""The objects nested in an OpenAI request body at the gateway, over scripted frame streams without a network: a key
OpenAI's API does not know is refused wherever it is, in OpenAI's words and with its path as `param`; what hearth
cannot honour in them is refused by name; and every value is bounded, a body too large or too deep included."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hearth.services.gateway.openai_models import ChatCompletionRequest
from tests.unit.test_withdrawn_tokens import MODEL, chat_body, done, gateway, token  # noqa: F401 (gateway is a fixture)

HI = {"role": "user", "content": "hi"}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CALLED = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
ANSWERED = [{"role": "assistant", "content": None, "tool_calls": [CALLED]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}, HI]


@pytest.mark.parametrize("fields, path", [
    ({"messages": [{**HI, "conten": "x"}]}, "messages[0].conten"),
    ({"messages": [HI, {"role": "user", "content": [{"type": "text", "text": "a", "txt": "b"}]}]},
     "messages[1].content[0].txt"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "prompt_cache_breakpoint": {"mode": "explicit", "tl": "30m"}}]}]},
     "messages[0].content[0].prompt_cache_breakpoint.tl"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALLED, "index": 0}]},
                   *ANSWERED[1:]]}, "messages[0].tool_calls[0].index"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALLED, "function": {**CALLED["function"], "args": "{}"}}]}, *ANSWERED[1:]]},
     "messages[0].tool_calls[0].function.args"),
    ({"tools": [{**LOOKUP, "strict": True}]}, "tools[0].strict"),
    ({"tools": [LOOKUP, {"type": "function", "function": {"name": "f", "paramters": {}}}]},
     "tools[1].function.paramters"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "lookup"}, "x": 1}},
     "tool_choice.x"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "lookup", "x": 1}}},
     "tool_choice.function.x"),
    ({"response_format": {"type": "json_schema", "schema": {"type": "object"}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}, "strct": True}}},
     "response_format.json_schema.strct"),
    ({"stream": True, "stream_options": {"include_usage": True, "include_usgae": True}},
     "stream_options.include_usgae"),
    ({"prediction": {"type": "content", "content": "x", "contents": "y"}}, "prediction.contents"),
    ({"prompt_cache_options": {"mode": "implicit", "tll": "30m"}}, "prompt_cache_options.tll"),
    ({"hearth": {"verfy": "all"}}, "hearth.verfy"),
])
async def test_a_key_openai_does_not_know_inside_an_object_is_refused_naming_its_path(gateway, fields, path):
    """Such keys were ignored: a misspelt `content` sent an empty message, a misspelt `include_usage` no usage."""
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(**fields))
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error == {"message": f"Unknown parameter: '{path}'.", "type": "invalid_request_error", "param": path,
                     "code": "unknown_parameter"}
    assert not scripted.received


async def test_a_key_openai_does_not_know_in_a_completion_s_stream_options_is_refused(gateway):
    http, scripted = gateway
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True,
                                                        "stream_options": {"usage": True}})
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, "stream_options.usage", "unknown_parameter")
    assert not scripted.received


async def test_an_unknown_key_of_any_length_is_refused_in_a_short_answer_without_a_param(gateway):
    http, _ = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(messages=[{**HI, "x" * 100_000: 1}]))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None, error
    assert error["message"].startswith("Unknown parameter: 'messages[0].xxx") and len(error["message"]) < 1_000


@pytest.mark.parametrize("fields, refused", [
    ({"tools": [{"type": "custom", "custom": {"name": "shell"}}]}, "tools.0: custom tools"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "allowed_tools",
                                         "allowed_tools": {"mode": "auto", "tools": [LOOKUP]}}},
     "tool_choice: 'allowed_tools'"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "custom", "custom": {"name": "shell"}}}, "tool_choice: custom tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "shell", "input": "ls"}}]}, HI]},
     "messages.0.tool_calls.0: custom tools"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, HI]},
     "messages.0.audio: "),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}, HI]},
     "messages.0.function_call: "),
    ({"messages": [{"role": "function", "name": "f", "content": "42"}, HI]}, "messages.0: messages of role 'function'"),
    ({"messages": [{**HI, "refusal": "no"}]}, "messages.0: only an assistant's message may hold a 'refusal'"),
])
async def test_what_hearth_cannot_honour_inside_an_object_is_refused_by_name(gateway, fields, refused):
    """Each of these is OpenAI's, so not unknown; hearth cannot do what it asks, so it is not ignored either."""
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(**fields))
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "bad_request"), error
    assert error["message"].startswith(refused), error
    assert not scripted.received


async def test_an_assistant_s_refusal_is_read_as_its_text(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    messages = [HI, {"role": "assistant", "content": None, "refusal": "I cannot."}, HI]
    response = await http.post("/v1/chat/completions", json=chat_body(messages=messages))
    assert response.status_code == 200, response.text
    assert [m.content for m in scripted.received[-1].messages] == ["hi", "I cannot.", "hi"]


def _deep(depth: int) -> str:
    return '{"a": ' * depth + "{}" + "}" * depth


@pytest.mark.parametrize("fields, status, code, param", [
    ({"messages": [{**HI, "name": "n" * 65}]}, 400, "string_above_max_length", "messages"),
    ({"messages": [{**HI, "name": "a b"}]}, 400, "bad_request", "messages"),
    ({"messages": [HI] * 4097}, 400, "array_above_max_length", "messages"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]}, 400,
     "array_above_max_length", "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALLED, "id": f"c{i}"} for i in
                                                                          range(1000)]}, HI]}, 400,
     "array_above_max_length", "messages"),
    ({"logit_bias": {str(i): 1 for i in range(10_000)}}, 400, "bad_request", "logit_bias"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "bad_request", "metadata"),
    ({"metadata": {"k": "v" * 513}}, 400, "string_above_max_length", "metadata"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALLED, "id": "c" * 129}]}, HI]}, 400,
     "string_above_max_length", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "x" * 65}]}]}, 400, "string_above_max_length", "messages"),
])
async def test_every_value_inside_an_object_is_bounded(gateway, fields, status, code, param):
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(**fields))
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (status, code, param), error
    assert len(error["message"]) < 2_000 and not scripted.received


@pytest.mark.parametrize("raw, status, code", [
    # Deeper than the JSON parser goes: refused while parsing, wherever it is.
    ('{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "metadata": %s}' % ("[" * 100_000 +
                                                                                               "]" * 100_000),
     400, "bad_request"),
    # Within the parser's depth, deeper than a schema may be.
    ('{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
     '"json_schema", "json_schema": {"name": "r", "schema": %s}}}' % _deep(100), 400, "bad_request"),
    ('{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "f", "parameters": %s}}]}' % _deep(100), 400, "bad_request"),
    (json.dumps(chat_body(messages=[{"role": "user", "content": "x" * 10_000_000}])), 413, "request_too_large"),
])
async def test_a_body_too_deep_or_too_large_is_refused_in_one_line(gateway, raw, status, code):
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", content=raw.encode())
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (status, code), error
    assert len(error["message"]) < 2_000 and not scripted.received


MANY = {f"k{i}": 0 for i in range(1_000)}


@pytest.mark.parametrize("fields", [
    {"messages": [{**HI, **MANY}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", **MANY}]}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALLED, **MANY}]}, *ANSWERED[1:]]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALLED, "function": {**CALLED["function"], **MANY}}]}, *ANSWERED[1:]]},
    {"tools": [{**LOOKUP, **MANY}]},
    {"tools": [{"type": "function", "function": {**LOOKUP["function"], **MANY}}]},
    {"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "lookup"}, **MANY}},
    {"response_format": {"type": "text", **MANY}},
    {"stream": True, "stream_options": {"include_usage": True, **MANY}},
    {"prediction": {"type": "content", "content": "x", **MANY}},
    {"prompt_cache_options": {"mode": "implicit", **MANY}},
    {"metadata": MANY},
])
def test_an_object_of_many_wrong_keys_is_refused_for_one_not_described_key_by_key(fields):
    """Validation runs on the event loop: a body's keys are not each described (their errors built and read back)."""
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate_json(json.dumps(chat_body(**fields)))
    # One error (and one for a union's other member), however many keys.
    assert refused.value.error_count() <= 2, refused.value.errors()[:3]

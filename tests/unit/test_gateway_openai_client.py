"""The gateway as OpenAI's official Python client meets it, over scripted frame streams without a network: what the
client reads from an answer or an error (`code`, `type`, `param`, the request id) is what OpenAI's API gives."""

from __future__ import annotations

import inspect

import openai
import pytest

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
    assert (response.status_code, error["param"], error["type"]) == (400, unknown, "invalid_request_error"), error
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

"""The gateway as OpenAI's own client and curl meet it, over scripted frame streams without a network: a model
retrieved by id, content parts hearth cannot read refused by name, bounds named by the field the client sent, fields
that ask for what hearth cannot give refused, and a failure the gateway did not foresee (its broker connection
closed) answered as an OpenAI error, a streamed one ending with an error event rather than a silent cut."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest
from nats.errors import ConnectionClosedError

from hearth.protocol.chat import BadRequest, max_tokens_limit, parse_chat_request
from hearth.protocol.chat_frames import ErrorFrame
from hearth.services.gateway.app import create_app
from tests.unit.test_gateway_hardening import CLOSE_WAIT_S, serving
from tests.unit.test_withdrawn_tokens import (  # noqa: F401 (gateway is a fixture)
    MODEL, ScriptedCall, ScriptedGateway, chat_body, done, events_of, gateway, token,
)


def openai_client(http: httpx2.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_404_model_not_found(gateway):
    http, _ = gateway
    model = await openai_client(http).models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "hearth")
    with pytest.raises(openai.NotFoundError) as missing:
        await openai_client(http).models.retrieve("never-served")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")


@pytest.mark.parametrize("part, kind", [
    ({"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
])
async def test_a_content_part_that_is_not_text_is_refused_by_its_type(gateway, part, kind):
    http, scripted = gateway
    content = [{"type": "text", "text": "what is this?"}, part]
    response = await http.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": content}]))
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, "messages"), error
    assert f"messages.0.content.1: content parts of type '{kind}' are not supported" in error["message"], error
    assert "TextPart" not in error["message"] and not scripted.received


@pytest.mark.parametrize("message, refused", [
    ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0: a 'text' part needs its 'text' string"),
    ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
     "messages.0.content.0: only an assistant's message may hold a 'refusal' part"),
])
async def test_a_text_or_refusal_part_that_cannot_be_read_is_refused_saying_why(gateway, message, refused):
    http, _ = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(messages=[message]))
    assert (response.status_code, response.json()["error"]["message"]) == (400, refused)


async def test_text_parts_and_an_assistant_s_refusal_part_are_read_as_text(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                {"role": "user", "content": "please"}]
    response = await http.post("/v1/chat/completions", json=chat_body(messages=messages))
    assert response.status_code == 200, response.text
    assert [m.content for m in scripted.received[-1].messages] == ["ab", "I cannot.", "please"]


@pytest.mark.parametrize("fields, param", [
    ({"max_completion_tokens": max_tokens_limit + 1}, "max_completion_tokens"),
    ({"max_tokens": max_tokens_limit + 1}, "max_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
async def test_a_value_out_of_bounds_is_a_400_naming_the_field_the_client_sent(gateway, fields, param):
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(**fields))
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param), error
    assert f"'{param}" in error["message"] and not scripted.received


@pytest.mark.parametrize("fields, param", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
])
async def test_fields_asking_for_what_hearth_cannot_give_are_refused_by_name(gateway, fields, param):
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(**fields))
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param), error
    assert not scripted.received


async def test_text_only_modalities_and_top_k_are_honoured(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    response = await http.post("/v1/chat/completions", json=chat_body(modalities=["text"], top_k=40))
    assert response.status_code == 200, response.text
    assert scripted.received[-1].top_k == 40


class BrokerClosedCall(ScriptedCall):
    """A call whose broker connection closes after `tokens` tokens."""

    def __init__(self, request, tokens: int) -> None:
        async def frames():
            for seq in range(tokens):
                yield token(seq, "x")
            raise ConnectionClosedError

        super().__init__(request, [])
        self._frames = frames()


class BrokerClosedGateway(ScriptedGateway):
    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens

    def call(self, request, caller):
        return BrokerClosedCall(request, self.tokens)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_closed_broker_connection_before_the_first_token_is_an_openai_shaped_503(stream):
    scripted = BrokerClosedGateway(tokens=0)
    transport = httpx2.ASGITransport(app=create_app(scripted), raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        response = await http.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert response.status_code == 503 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert scripted.open_calls == 0


async def test_a_stream_cut_by_a_failure_ends_with_an_error_event_that_openai_s_client_raises():
    scripted = BrokerClosedGateway(tokens=2)
    transport = httpx2.ASGITransport(app=create_app(scripted), raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        response = await http.post("/v1/chat/completions", json=chat_body(stream=True))
        events = events_of(response)
        assert events[-1] != "[DONE]" and json.loads(events[-1])["error"]["type"] == "service_unavailable_error"
        stream = await openai_client(http).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    assert scripted.open_calls == 0


async def test_a_model_list_with_the_broker_connection_closed_is_an_openai_shaped_503():
    class ClosedCatalogGateway(ScriptedGateway):
        async def models(self):
            raise ConnectionClosedError

    transport = httpx2.ASGITransport(app=create_app(ClosedCatalogGateway()), raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        listed = await http.get("/v1/models")
        retrieved = await http.get(f"/v1/models/{MODEL}")
    for response in (listed, retrieved):
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable_error"


class EndlessCall(ScriptedCall):
    """A call that sends one token and then waits for the next for ever, noting when it is closed."""

    def __init__(self, request, closed: asyncio.Event) -> None:
        async def frames():
            try:
                yield token(0, "x")
                await asyncio.Event().wait()
            finally:
                closed.set()

        super().__init__(request, [])
        self._frames = frames()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_while_its_call_waits_for_a_token_has_the_call_closed_at_once(stream):
    closed = asyncio.Event()

    class EndlessGateway(ScriptedGateway):
        def call(self, request, caller):
            return EndlessCall(request, closed)

    scripted = EndlessGateway()
    async with serving(scripted) as address:
        reader, writer = await asyncio.open_connection(*address)
        body = json.dumps(chat_body(stream=stream)).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        if stream:
            assert b'"content":"x"' in await asyncio.wait_for(reader.readuntil(b'"content":"x"'), CLOSE_WAIT_S)
        else:
            while not scripted.open_calls:
                await asyncio.sleep(0.01)
        writer.close()
        await asyncio.wait_for(closed.wait(), CLOSE_WAIT_S)
        while scripted.open_calls:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("path, fields", [("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "x"})])
async def test_a_seed_anywhere_in_openai_s_range_is_taken_and_the_same_seed_draws_the_same(gateway, path, fields):
    """OpenAI's seed is any 64-bit signed integer; hearth's is 0 to 2**63 - 1, so a negative one is carried into
    that range, one to one for the seeds a client would pick."""
    http, scripted = gateway
    body = {"model": MODEL, **(fields or {"messages": [{"role": "user", "content": "hi"}]})}
    seeds = []
    for seed in (-1, -(2**63), 7, -1):
        scripted.scripts.append([token(0, "ok"), done(1, 1)])
        response = await http.post(path, json={**body, "seed": seed})
        assert response.status_code == 200, response.text
        seeds.append(scripted.received[-1].seed)
    assert seeds[0] == seeds[3] and len(set(seeds[:3])) == 3 and all(0 <= seed < 2**63 for seed in seeds)
    response = await http.post(path, json={**body, "seed": 2**63})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "seed")


async def test_top_p_0_which_openai_takes_is_the_greedy_answer(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    response = await http.post("/v1/chat/completions", json=chat_body(top_p=0, temperature=0.7))
    assert response.status_code == 200, response.text
    assert (scripted.received[-1].temperature, scripted.received[-1].top_p) == (0.0, 1.0)


async def test_a_streamed_tool_call_s_argument_fragments_carry_no_name_as_openai_s_do(gateway):
    """After the fragment that names the function, OpenAI's fragments hold only `index` and `function.arguments`: a
    client that appends every fragment's name would otherwise read "lookupNone" (or "lookupnull")."""
    http, scripted = gateway
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    scripted.scripts.append([token(0, '{"name": "lookup", "arguments": {"q'), token(1, '": "x"}}'),
                             done(2, 2).model_copy(update={"finish_reason": "tool_calls"})])
    response = await http.post("/v1/chat/completions", json=chat_body(tools=[lookup], stream=True))
    fragments = [call for event in events_of(response)[:-1] for choice in json.loads(event)["choices"]
                 for call in choice["delta"].get("tool_calls", [])]
    assert fragments[0]["function"]["name"] == "lookup"
    assert all(set(fragment) == {"index", "function"} and set(fragment["function"]) == {"arguments"}
               for fragment in fragments[1:]), fragments
    assert json.loads("".join(fragment["function"]["arguments"] for fragment in fragments)) == {"q": "x"}


CHAT_NULLABLE = ("frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
                 "modalities", "n", "presence_penalty", "response_format", "seed", "service_tier", "stop", "store",
                 "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
                 "audio", "web_search_options", "parallel_tool_calls", "reasoning_effort", "prediction")
COMPLETION_NULLABLE = ("best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                       "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                       "top_p", "user")


@pytest.mark.parametrize("path, body, nullable", [
    ("/v1/chat/completions", chat_body(), CHAT_NULLABLE),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, COMPLETION_NULLABLE),
])
async def test_every_optional_field_sent_as_null_means_left_out(gateway, path, body, nullable):
    """OpenAI's API takes null for each of its optional fields (clients that serialise every field send them)."""
    http, scripted = gateway
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    response = await http.post(path, json={**body, **dict.fromkeys(nullable)})
    assert response.status_code == 200, response.text
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    streamed = await http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and events_of(streamed)[-1] == "[DONE]", streamed.text


def _many(item: str, count: int = 150_000) -> str:
    return "[" + ",".join([item] * count) + "]"


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", '{"model": "scripted", "prompt": %s}' % _many("1")),  # token ids
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": %s}]}' % _many("{}")),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "stop": %s}'
     % _many("1")),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "tools": %s}'
     % _many("1")),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "assistant", "content": "x", '
                             '"tool_calls": %s}]}' % _many("1")),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "logit_bias": '
                             '{%s}}' % ",".join(f'"{i}": "a"' for i in range(80_000))),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "hearth": '
                             '{%s}}' % ",".join(f'"k{i}": 1' for i in range(80_000))),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "logit_bias": '
                             '{%s}}' % ",".join(f'"{i}": 1' for i in range(80_000))),
])
async def test_a_body_with_many_wrong_items_is_refused_in_a_few_lines_not_one_per_item(gateway, path, raw):
    """Each wrong item of a list used to be described: a 1 MB body drew an answer of tens of MB, built on the event
    loop for seconds."""
    http, scripted = gateway
    assert len(raw) < 1_048_576
    response = await http.post(path, content=raw.encode())
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is not None, error
    assert len(error["message"]) < 2_000, error["message"][:500]
    assert not scripted.received


def test_llm_chat_request_with_many_wrong_logit_biases_is_refused_in_one_line():
    """The orchestrator's own parse of `llm.chat.request`, which another client than the gateway may send."""
    entries = ",".join(f'"{token_id}": "a"' for token_id in range(50_000))
    with pytest.raises(BadRequest) as refused:
        parse_chat_request(('{"prompt": "x", "logit_bias": {%s}}' % entries).encode())
    assert len(str(refused.value)) < 500 and "logit_bias" in str(refused.value), str(refused.value)[:500]


@pytest.mark.parametrize("message, code, param", [
    ("fields 'messages' and 'max_tokens': the prompt's 900 tokens plus max_tokens 200 = 1100 exceed the model's "
     "context of 1024 tokens", "context_length_exceeded", "messages"),
    ("fields 'prompt' and 'max_tokens': the prompt's at least 5000 tokens plus max_tokens 16 exceed the model's "
     "context of 2048 tokens", "context_length_exceeded", "prompt"),
    ("field 'logit_bias.99999': token id 99999 is not in the model's vocabulary of 32000 tokens", "bad_request",
     "logit_bias"),
    ("a request carries exactly one of 'messages' or 'prompt'", "bad_request", None),
])
async def test_the_mesh_s_refusals_name_their_field_and_a_prompt_over_the_context_is_openai_s_code(
        gateway, message, code, param):
    """Clients trim a conversation when OpenAI answers `context_length_exceeded`; they read `param` for the field."""
    http, scripted = gateway
    scripted.scripts.append([ErrorFrame(seq=0, code="bad_request", message=message)])
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert (refused.value.status_code, refused.value.code, refused.value.param) == (400, code, param)


async def test_a_stream_whose_frames_end_without_a_final_one_ends_with_that_error_event(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "a"), token(1, "b")])
    response = await http.post("/v1/chat/completions", json=chat_body(stream=True))
    error = json.loads(events_of(response)[-1])["error"]
    assert "ended without a final frame" in error["message"], error

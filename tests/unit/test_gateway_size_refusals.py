"""A request refused for its size reaches an OpenAI client as OpenAI answers it, whether the mesh refused it (its
error frame) or the gateway did: a prompt over the model's context 400 `context_length_exceeded`, a body over
max_request_bytes 413 `request_too_large`, too many messages 400 `array_above_max_length`, a string too long 400
`string_above_max_length`, each naming its field in `param`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest

from hearth.protocol.chat import BadRequest, ChatRequest, max_messages, max_prompt_chars, parse_chat_request
from hearth.protocol.chat_frames import ErrorFrame
from hearth.protocol.refusals import body_too_large
from hearth.services.gateway.openai_models import openai_max_stop_strings
from hearth.services.orchestrator.admission import prompt_room
from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import MODEL, chat_body, gateway  # noqa: F401 (a fixture)

MESSAGE = {"role": "user", "content": "hi"}


def refusal_of_the_mesh(body: dict) -> str:
    """What the orchestrator's own parse of `llm.chat.request` says of `body`."""
    with pytest.raises(BadRequest) as refused:
        parse_chat_request(json.dumps(body).encode())
    return str(refused.value)


def refusal_of_max_tokens(max_tokens: int, context_length: int) -> str:
    """What the orchestrator says of a max_tokens that leaves the prompt no room in the model's context."""
    head = SimpleNamespace(info=SimpleNamespace(vocab_size=32_000))
    model = SimpleNamespace(head=head, context_length=context_length)
    with pytest.raises(BadRequest) as refused:
        prompt_room(ChatRequest(prompt="x", max_tokens=max_tokens), model)
    return str(refused.value)


@pytest.mark.parametrize("refusal, status, code, param", [
    (lambda: body_too_large(2_000_000, 1_048_576), 413, "request_too_large", None),
    (lambda: refusal_of_max_tokens(4000, 2048), 400, "context_length_exceeded", "max_tokens"),
    (lambda: refusal_of_the_mesh({"messages": [MESSAGE] * (max_messages + 1)}), 400, "array_above_max_length",
     "messages"),
    (lambda: refusal_of_the_mesh({"prompt": "x" * (max_prompt_chars + 1)}), 400, "string_above_max_length",
     "prompt"),
    (lambda: refusal_of_the_mesh({"prompt": "x", "temperature": 11}), 400, "bad_request", "temperature"),
], ids=["body", "max_tokens", "messages", "prompt", "not-a-size"])
async def test_the_mesh_s_refusal_for_a_size_is_openai_s_status_and_code(gateway, refusal, status, code, param):
    """The gateway checks the body against its own copy of the bounds; an orchestrator configured tighter refuses
    what passed, and that refusal must read as the gateway's own would."""
    http, scripted = gateway
    scripted.scripts.append([ErrorFrame(seq=0, code="bad_request", message=refusal())])
    with pytest.raises(openai.APIStatusError) as refused:
        await openai_client(http).chat.completions.create(model=MODEL, messages=[MESSAGE])
    assert (refused.value.status_code, refused.value.code, refused.value.param) == (status, code, param)
    assert refused.value.type == "invalid_request_error"


@pytest.mark.parametrize("changes, code, param", [
    ({"messages": [MESSAGE] * (max_messages + 1)}, "array_above_max_length", "messages"),
    ({"messages": [{"role": "user", "content": "x" * (max_prompt_chars + 1)}]}, "string_above_max_length",
     "messages"),
    ({"stop": ["x"] * (openai_max_stop_strings + 1)}, "array_above_max_length", "stop"),
], ids=["messages", "content", "stop"])
async def test_the_gateway_s_own_refusal_for_a_size_is_the_same_status_and_code_unpublished(
        gateway, changes, code, param):
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(**changes))
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, code, param), error
    assert not scripted.received

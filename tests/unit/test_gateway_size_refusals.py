"""A request refused for its size reaches an OpenAI client as OpenAI answers it, whether the mesh refused it (its
error frame) or the gateway did: a prompt over the model's context 400 `context_length_exceeded`, a body over
max_request_bytes 413 `request_too_large`, too many messages 400 `array_above_max_length`, a string too long 400
`string_above_max_length`, an unknown model 404 `model_not_found`, each naming its field in `param`. The mesh's
frame says the reason and the field typed (`refusal`, `param`), so a reworded message is answered alike; a frame
without them (from an orchestrator older than the fields) is told by its words."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest.mock import MagicMock

import openai
import pytest

from hearth.protocol.chat import BadRequest, ChatRequest, max_messages, max_prompt_chars, parse_chat_request
from hearth.protocol.chat_frames import ErrorFrame, decode_frame
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.errors import from_frame
from hearth.services.gateway.openai_models import openai_max_stop_strings
from hearth.services.orchestrator.admission import prompt_room
from hearth.services.orchestrator.catalog import UnknownModel
from hearth.services.orchestrator.service import Orchestrator
from tests.orchestrator_stand_ins import RecordingClient
from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import MODEL, chat_body, gateway  # noqa: F401 (a fixture)

MESSAGE = {"role": "user", "content": "hi"}


def refusal_of_the_mesh(body: dict) -> ErrorFrame:
    """The frame the orchestrator answers `body` with when its own parse of `llm.chat.request` refuses it."""
    with pytest.raises(BadRequest) as refused:
        parse_chat_request(json.dumps(body).encode())
    return ErrorFrame.refusing(refused.value)


def refusal_of_max_tokens(max_tokens: int, context_length: int) -> ErrorFrame:
    """The frame for a max_tokens that leaves the prompt no room in the model's context."""
    head = SimpleNamespace(info=SimpleNamespace(vocab_size=32_000))
    model = SimpleNamespace(head=head, context_length=context_length)
    with pytest.raises(BadRequest) as refused:
        prompt_room(ChatRequest(prompt="x", max_tokens=max_tokens), model)
    return ErrorFrame.refusing(refused.value)


def refusal_of_a_large_body() -> ErrorFrame:
    """The frame for a body over the orchestrator's max_request_bytes, checked before it is parsed."""
    settings = HearthSettings()
    body = b"x" * (settings.orchestrator.max_request_bytes + 1)
    return Orchestrator._oversized(SimpleNamespace(settings=settings), SimpleNamespace(data=body, headers=None))


MESH_REFUSALS = pytest.mark.parametrize("refusal, status, code, param", [
    (refusal_of_a_large_body, 413, "request_too_large", None),
    (lambda: refusal_of_max_tokens(4000, 2048), 400, "context_length_exceeded", "max_tokens"),
    (lambda: refusal_of_the_mesh({"messages": [MESSAGE] * (max_messages + 1)}), 400, "array_above_max_length",
     "messages"),
    (lambda: refusal_of_the_mesh({"prompt": "x" * (max_prompt_chars + 1)}), 400, "string_above_max_length",
     "prompt"),
    (lambda: refusal_of_the_mesh({"prompt": "x", "temperature": 11}), 400, "bad_request", "temperature"),
], ids=["body", "max_tokens", "messages", "prompt", "not-a-size"])


@MESH_REFUSALS
@pytest.mark.parametrize("told_by", ["its-fields", "its-words"])
async def test_the_mesh_s_refusal_for_a_size_is_openai_s_status_and_code(gateway, refusal, status, code, param,
                                                                         told_by):
    """The gateway checks the body against its own copy of the bounds; an orchestrator configured tighter refuses
    what passed, and that refusal must read as the gateway's own would: by the frame's fields whatever its message
    says, or by its message alone when it has no fields."""
    http, scripted = gateway
    frame = refusal()
    if told_by == "its-fields":
        frame = frame.model_copy(update={"message": "refused, in words no gateway knows"})
    else:
        frame = ErrorFrame(seq=0, code="bad_request", message=frame.message)
    scripted.scripts.append([frame])
    with pytest.raises(openai.APIStatusError) as refused:
        await openai_client(http).chat.completions.create(model=MODEL, messages=[MESSAGE])
    assert (refused.value.status_code, refused.value.code, refused.value.param) == (status, code, param)
    assert refused.value.type == "invalid_request_error"


@MESH_REFUSALS
def test_the_mesh_s_refusal_carries_its_reason_on_the_wire(refusal, status, code, param):
    sent = json.loads(refusal().model_dump_json())
    assert sent.get("param") == param
    assert ("refusal" in sent) == (code != "bad_request")
    assert from_frame(decode_frame(sent)).code == code


def test_a_reason_this_side_does_not_know_reads_as_none_and_the_frame_still_counts():
    frame = decode_frame({"type": "error", "seq": 0, "code": "bad_request", "message": "field 'prompt': too odd",
                          "refusal": "too_odd", "param": "prompt"})
    assert (frame.refusal, frame.param) == (None, "prompt")
    assert (from_frame(frame).status, from_frame(frame).param) == (400, "prompt")


def test_an_unknown_key_too_long_to_carry_is_refused_without_a_param():
    with pytest.raises(BadRequest) as refused:
        parse_chat_request(json.dumps({"prompt": "x", "k" * 1000: 1}).encode())
    assert refused.value.param is None
    assert ErrorFrame.refusing(refused.value).param is None  # the frame is made, not refused itself


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


@pytest.mark.parametrize("model, context_length, refusal, param, status", [
    ("never-served", 2048, "unknown_model", "model", 404),
    (MODEL, 16, "context_exceeded", "max_tokens", 400),
], ids=["unknown-model", "context"])
async def test_the_orchestrator_s_refusal_of_a_call_says_its_reason_and_field(monkeypatch, model, context_length,
                                                                             refusal, param, status):
    orchestrator = Orchestrator(MagicMock(), HearthSettings(), node_id="orchestrator-refusals")
    orchestrator.enabled = True
    loaded = SimpleNamespace(head=SimpleNamespace(info=SimpleNamespace(vocab_size=32_000)),
                             context_length=context_length)

    async def get_requested(name):
        if name != MODEL:
            raise UnknownModel(f"unknown model {name!r}: not one this orchestrator serves")
        return loaded

    orchestrator.catalog.close()
    orchestrator.catalog = SimpleNamespace(get_requested=get_requested, close=lambda: None)
    client = RecordingClient()
    request = ChatRequest(model=model, prompt="hello", max_tokens=64)
    await orchestrator._serve_request(SimpleNamespace(data=request.model_dump_json().encode(), headers=None),
                                      client, None)
    [frame] = client.sent
    assert (frame.code, frame.refusal, frame.param) == ("bad_request", refusal, param)
    assert from_frame(frame.model_copy(update={"message": "no"})).status == status

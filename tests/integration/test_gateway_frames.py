"""The gateway's app over a real nats-server, with a scripted stand-in for the orchestrator answering
`llm.chat.request`: frames the HTTP answer does not carry (failover, shard status, keepalive, a `queued` frame an
admission queue sends, a type added later) leave the stream whole, so do frames sent again after a broker node
went away, and each way a call can end has its HTTP answer: 429 with the Retry-After the frame names, 503 for a
stalled pipeline, an error event mid-stream; a request its mapping onto `llm.chat.request` grows past
max_request_bytes is refused by the gateway, never published."""

from __future__ import annotations

import json
import re

import httpx2
import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT
from hearth.services.common.config import HearthSettings
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.gateway.app import create_app
from hearth.services.gateway.mesh import Gateway
from tests.unit.test_gateway_retry_hints import waits_as_named

pytestmark = pytest.mark.integration
MODEL = "scripted"


def token(seq: int, text: str) -> dict:
    return {"type": "token_delta", "seq": seq, "text": text, "token_id": seq}


DONE = {"type": "done", "finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.fixture
async def scripted(nats_url):
    """(gateway app client, the frames the next call is answered with, the requests received, and `llm.models`
    requests received)."""
    orchestrator = await connect_nats(nats_url, name="scripted-orchestrator")
    gateway_nc = await connect_nats(nats_url, name="gateway")
    script: list[list[dict]] = []
    received: list[ChatRequest] = []
    models_asked: list[bytes] = []
    limit = HearthSettings().orchestrator.max_request_bytes

    async def answer(msg) -> None:
        received.append(ChatRequest.model_validate_json(msg.data))
        if len(msg.data) > limit:  # refused as the orchestrator refuses it
            refusal = {"type": "error", "seq": 0, "code": "bad_request",
                       "message": f"body: {len(msg.data)} bytes is over max_request_bytes {limit}"}
            await orchestrator.publish(msg.reply, json.dumps(refusal).encode())
            return
        for frame in script.pop(0):
            await orchestrator.publish(msg.reply, json.dumps(frame).encode())

    async def models(msg) -> None:
        models_asked.append(msg.data)
        reply = ModelsReply(models=[ServedModel(id=MODEL, total_layers=2, complete=True)], default_model=MODEL)
        await msg.respond(reply.model_dump_json().encode())

    await orchestrator.subscribe(CHAT_REQUEST_SUBJECT, cb=answer)
    await orchestrator.subscribe(MODELS_REQUEST_SUBJECT, cb=models)
    await flush_ordered(orchestrator)
    app = create_app(Gateway(gateway_nc, HearthSettings(), keyring=None))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http, script, received, models_asked
    await gateway_nc.close()
    await orchestrator.close()


def body(**changes) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **changes}


def compact_body_at_the_limit(model: str) -> bytes:
    """A request body of exactly [orchestrator] max_request_bytes, with no field the mapping could shorten."""
    limit = HearthSettings().orchestrator.max_request_bytes
    compact = {"model": model, "messages": [{"role": "user", "content": ""}, {"role": "user", "content": ""}]}
    padding = limit - len(json.dumps(compact, separators=(",", ":")))
    # Two messages: one may hold at most max_prompt_chars.
    compact["messages"][0]["content"] = "x" * (padding // 2)
    compact["messages"][1]["content"] = "y" * (padding - padding // 2)
    sent = json.dumps(compact, separators=(",", ":")).encode()
    assert len(sent) == limit
    return sent


async def test_frames_the_answer_does_not_carry_leave_the_stream_whole(scripted):
    http, script, received, _ = scripted
    script.append([
        {"type": "queued", "seq": 0, "position": 3, "queued_requests": 3},
        {"type": "pipeline", "seq": 1, "pipeline_id": "p", "hops": ["a", "b"]},
        token(2, "Hel"),
        {"type": "shard_status", "seq": 3, "shard_id": "a", "status": "degraded", "reason": "gone"},
        {"type": "keepalive", "seq": 3},
        {"type": "shard_failover", "seq": 4, "failed_shard_id": "a", "replacement_hops": ["c", "b"],
         "resumed_at_token": 1},
        {"type": "from_the_future", "seq": 5},
        token(6, "lo"), {**DONE, "seq": 7}])
    response = await http.post("/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": True},
                                                                 stop="x", seed=7, top_p=0.5))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Hello"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    sent = received[-1]
    assert (sent.stop, sent.seed, sent.top_p, sent.temperature, sent.max_tokens) == (["x"], 7, 0.5, 1.0, None)


async def test_frames_sent_again_after_a_gap_make_the_answer_once_and_in_order(scripted):
    """After a broker node went away the orchestrator sends again what a caller missed, and more than that: frames
    after a gap wait for it to be filled, frames seen before are skipped; a gap never filled ends the call."""
    http, script, _, _ = scripted
    script.append([token(0, "He"), token(2, "lo"), token(0, "He"), token(1, "l"), token(2, "lo"),
                   {"type": "keepalive", "seq": 2}, {**DONE, "seq": 3}])
    response = await http.post("/v1/chat/completions", json=body())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello"

    script.append([token(0, "He"), token(2, "lo"), {**DONE, "seq": 3}])
    response = await http.post("/v1/chat/completions", json=body())
    assert (response.status_code, response.json()["error"]["code"]) == (503, "pipeline_stalled")
    assert "frames 1-1 were lost" in response.json()["error"]["message"]


async def test_a_body_within_the_limit_that_the_mapping_grows_past_it_is_refused_by_the_gateway_unpublished(scripted):
    """What the gateway publishes carries hearth's defaults for every field the client left out (and a request id),
    so a compact body just within [orchestrator] max_request_bytes is over it once mapped: the gateway refuses it
    itself (413), naming that size and the limit, rather than passing on the orchestrator's refusal of a size the client
    never sent."""
    http, _, received, _ = scripted
    limit = HearthSettings().orchestrator.max_request_bytes
    sent = compact_body_at_the_limit(model=MODEL)
    response = await http.post("/v1/chat/completions", content=sent, headers={"Content-Type": "application/json"})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["type"]) == (413, "request_too_large", "invalid_request_error")
    size = re.match(r"body: (\d+) bytes as sent on to the mesh", error["message"])
    assert size and int(size[1]) > limit, error["message"]
    assert f"max_request_bytes {limit}" in error["message"]
    assert not received, "the request was published"


async def test_an_oversized_request_naming_an_unknown_model_is_refused_for_its_size_without_asking_the_mesh(scripted):
    """The size as published is checked before the model: a member cannot make the gateway query `llm.models` with
    requests it refuses anyway."""
    http, _, received, models_asked = scripted
    sent = compact_body_at_the_limit(model="never-served")
    response = await http.post("/v1/chat/completions", content=sent, headers={"Content-Type": "application/json"})
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (413, "request_too_large"), error
    assert "as sent on to the mesh" in error["message"]
    assert not received and not models_asked


async def test_overloaded_is_429_with_retry_after(scripted):
    """Retry-After is the frame's `retry_after_s` where the orchestrator names one (tests/unit/test_gateway_mapping.py),
    else [gateway] retry_after_s."""
    http, script, _, _ = scripted
    script.append([{"type": "error", "seq": 0, "code": "overloaded", "message": "queue full"}])
    response = await http.post("/v1/chat/completions", json=body())
    assert response.status_code == 429 and waits_as_named(response.headers, 1)
    assert response.json()["error"]["code"] == "overloaded"
    script.append([{"type": "error", "seq": 0, "code": "overloaded", "message": "busy"}])
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert response.status_code == 429 and waits_as_named(response.headers, 1)


async def test_a_stalled_pipeline_is_503_before_the_first_token_and_an_error_event_after_it(scripted):
    http, script, _, _ = scripted
    stalled = {"type": "pipeline_aborted", "code": "pipeline_stalled", "reason": "broker gone"}
    script.append([{**stalled, "seq": 0}])
    response = await http.post("/v1/chat/completions", json=body(stream=True))
    assert (response.status_code, response.json()["error"]["code"]) == (503, "pipeline_stalled")
    script.append([token(0, "Hi"), {**stalled, "seq": 1}])
    response = await http.post("/v1/chat/completions", json=body(stream=True))
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines() if line]
    assert response.status_code == 200 and "[DONE]" not in response.text
    assert events[-1]["error"]["code"] == "pipeline_stalled"
    script.append([token(0, "Hi"), {**stalled, "seq": 1}])
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert (response.status_code, response.json()["error"]["type"]) == (503, "service_unavailable_error")

"""A conversation's next turn goes to the orchestrator that answered the last (hearth/services/client/pinned.py,
hearth/services/gateway/conversations.py), over a real nats-server with scripted stand-ins for two orchestrators,
each answering the queue group's subject and its own: a pinned call reaches its orchestrator only; it goes to the
queue group at once when nobody listens on that subject, and when the orchestrator answers `overloaded` before any
token, or after a silence (not the first-frame wait), but not for any other ending; the gateway sends a request that
extends a conversation it carried to the orchestrator that answered it, for the same member only; so does `hearth
chat --interactive`, which refuses a line no message may carry in one line."""

from __future__ import annotations

import io
import time

import httpx2
import pytest

from hearth.protocol.chat import ChatRequest, max_prompt_chars
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT, orchestrator_request_subject
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.client.chat import ChatResult
from hearth.services.client.command import EXIT_BAD_REQUEST, _conversation
from hearth.services.client.pinned import stream_chat_pinned
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.conversations import ConversationPins
from hearth.services.gateway.mesh import Gateway
from tests.scripted_orchestrators import ScriptedOrchestrators

pytestmark = pytest.mark.integration
MODEL = "scripted"
# Waits long enough that a fallback at once (no responders, `overloaded`) and one after a silence or the first-frame
# wait stay apart by a wide margin on a loaded machine: "at once" is under a third of the silence.
long_waits = {"first_frame_timeout": 60.0, "frame_gap_timeout": 30.0}
at_once_s = long_waits["frame_gap_timeout"] / 3


@pytest.fixture
async def mesh(nats_url):
    orchestrators_nc = await connect_nats(nats_url, name="scripted-orchestrators")
    client_nc = await connect_nats(nats_url, name="client")
    try:
        yield ScriptedOrchestrators(orchestrators_nc), client_nc
    finally:
        await client_nc.close()
        await orchestrators_nc.close()


async def call(nc, orchestrator: str | None, **timeouts: float) -> tuple[ChatResult, float]:
    started = time.perf_counter()
    result = ChatResult()
    async for frame in stream_chat_pinned(nc, ChatRequest(model=MODEL, prompt="hi", max_tokens=1),
                                          orchestrator=orchestrator, **timeouts):
        result.frames.append(frame)
    return result, time.perf_counter() - started


async def test_a_pinned_call_reaches_its_orchestrator_and_only_it(mesh):
    orchestrators, nc = mesh
    await orchestrators.start("orch-a")
    await orchestrators.start("orch-b")
    for _ in range(4):
        result, _ = await call(nc, "orch-b")
        assert result.ok and result.final.orchestrator == "orch-b"
    assert orchestrators.heard["orch-b"] == [orchestrator_request_subject("orch-b")] * 4
    assert not orchestrators.heard["orch-a"]


async def test_a_pinned_call_nobody_hears_goes_to_the_queue_group_at_once(mesh):
    orchestrators, nc = mesh
    await orchestrators.start("orch-a")
    result, took_s = await call(nc, "orch-gone", **long_waits)
    assert result.ok and result.final.orchestrator == "orch-a"
    assert took_s < at_once_s, f"the fallback took {took_s:.1f} s: it waited for a silence, not for no responders"
    assert [frame.type for frame in result.frames] == ["token_delta", "done"]


async def test_a_pinned_call_nothing_answers_goes_to_the_queue_group_after_a_silence_not_the_first_frame_wait(mesh):
    """A publish that nobody answers and that gets no "no responders" (a broker whose permissions predate the
    orchestrators' own subjects drops it; here a subscriber that never answers): the turn goes to the queue group
    once the orchestrator has been silent as long as one mid-call would be gone, not after the first-frame wait."""
    orchestrators, nc = mesh
    await orchestrators.start("orch-a")

    async def never_answer(msg) -> None:
        pass

    await orchestrators.nc.subscribe(orchestrator_request_subject("orch-mute"), cb=never_answer)
    await flush_ordered(orchestrators.nc)
    silence_s = 1.0
    result, took_s = await call(nc, "orch-mute", first_frame_timeout=long_waits["first_frame_timeout"],
                                frame_gap_timeout=silence_s)
    assert result.ok and result.final.orchestrator == "orch-a"
    assert took_s < long_waits["first_frame_timeout"] / 3, f"the fallback took {took_s:.1f} s"


async def test_an_overloaded_orchestrator_sends_the_turn_to_the_queue_group_other_endings_do_not(mesh):
    orchestrators, nc = mesh
    await orchestrators.start("orch-a")
    await orchestrators.start("orch-busy", in_queue=False)
    overloaded = {"type": "error", "seq": 0, "code": "overloaded", "message": "full", "retry_after_s": 1.0}
    orchestrators.answers["orch-busy"] = [overloaded]
    result, took_s = await call(nc, "orch-busy", **long_waits)
    assert result.ok and result.final.orchestrator == "orch-a" and took_s < at_once_s
    assert orchestrators.heard["orch-busy"] == [orchestrator_request_subject("orch-busy")]
    # Any other refusal is the answer; so is an ending after a token (the text would be sent twice).
    orchestrators.answers["orch-busy"] = [{**overloaded, "code": "bad_request"}]
    result, _ = await call(nc, "orch-busy")
    assert result.error.code == "bad_request"
    orchestrators.answers["orch-busy"] = [{"type": "token_delta", "seq": 0, "text": "a", "token_id": 1},
                                          {"type": "pipeline_aborted", "seq": 1, "code": "overloaded", "reason": "x"}]
    result, _ = await call(nc, "orch-busy")
    assert result.error.code == "overloaded" and result.text == "a"
    assert len(orchestrators.heard["orch-a"]) == 1


async def test_the_gateway_sends_a_conversation_s_next_turn_to_the_orchestrator_that_answered_it(mesh, nats_url):
    orchestrators, _ = mesh
    for name in ("orch-a", "orch-b"):
        await orchestrators.start(name)

    async def models(msg) -> None:
        reply = ModelsReply(models=[ServedModel(id=MODEL, total_layers=2, complete=True)], default_model=MODEL)
        await msg.respond(reply.model_dump_json().encode())

    await orchestrators.nc.subscribe(MODELS_REQUEST_SUBJECT, cb=models)
    await flush_ordered(orchestrators.nc)
    gateway_nc = await connect_nats(nats_url, name="gateway")
    gateway = Gateway(gateway_nc, HearthSettings(), keyring=None)
    try:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(gateway)),
                                      base_url="http://gateway") as http:
            history = [{"role": "user", "content": "hello"}]
            response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
            first = next(name for name, subjects in orchestrators.heard.items() if subjects)
            for turn in range(3):
                history += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
                            {"role": "user", "content": f"and then {turn}?"}]
                response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
                assert response.status_code == 200
            assert orchestrators.heard[first][1:] == [orchestrator_request_subject(first)] * 3
            assert len(gateway.pins) == 4
    finally:
        await gateway_nc.close()


def test_pins_are_per_member_and_bounded():
    pins = ConversationPins(capacity=2)
    turn = ChatRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    pins.remember("alice", turn, "orch-a")
    going_on = ChatRequest(model=MODEL, messages=[*turn.messages, {"role": "assistant", "content": "yes"},
                                                  {"role": "user", "content": "more"}])
    assert pins.pinned("alice", going_on) == "orch-a"
    assert pins.pinned("bob", going_on) is None and pins.pinned(None, going_on) is None
    assert pins.pinned("alice", turn) is None  # a first turn goes on from nothing
    for index in range(2):
        pins.remember("alice", ChatRequest(model=MODEL, messages=[{"role": "user", "content": str(index)}]), "x")
    assert len(pins) == 2 and pins.pinned("alice", going_on) is None


async def test_hearth_chat_interactive_sends_each_next_turn_to_the_orchestrator_that_answered(
        mesh, nats_url, monkeypatch, capsys):
    orchestrators, _ = mesh
    for name in ("orch-a", "orch-b"):
        await orchestrators.start(name)
    monkeypatch.setattr("sys.stdin", io.StringIO("and then?\nand after that?\n\n"))
    first_turn = ChatRequest(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert await _conversation(nats_url, first_turn, nats_settings=None) == 0
    first = next(name for name, subjects in orchestrators.heard.items() if subjects)
    assert orchestrators.heard[first] == [CHAT_REQUEST_SUBJECT] + [orchestrator_request_subject(first)] * 2
    assert [len(request.messages) for request in orchestrators.requests] == [1, 3, 5]
    assert orchestrators.requests[-1].messages[-2].content == "ok"
    assert capsys.readouterr().out == "ok\nok\nok\n"


@pytest.mark.parametrize("line", ["x" * (max_prompt_chars + 1), "caf\udce9"], ids=["too long", "not utf-8"])
async def test_hearth_chat_interactive_refuses_a_line_no_message_may_carry_in_one_line(
        mesh, nats_url, monkeypatch, capsys, line):
    orchestrators, _ = mesh
    await orchestrators.start("orch-a")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{line}\nnever sent\n"))
    first_turn = ChatRequest(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert await _conversation(nats_url, first_turn, nats_settings=None) == EXIT_BAD_REQUEST  # the caller's input
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error bad_request: ") and len(orchestrators.requests) == 1

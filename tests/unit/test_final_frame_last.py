"""A call's final frame goes out last (hearth/services/orchestrator/client_stream.py `ClientStream.final_frame_last`):
after the call let go of its running place, so a caller that saw its call end may at once call again within its
share; frames before it keep their order, and a body that fails still sends the final frame it held."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import DoneFrame, ErrorFrame, TokenDeltaFrame, Usage
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator import call_serving
from hearth.services.orchestrator.client_stream import ClientStream
from hearth.services.orchestrator.service import Orchestrator


class Inbox:
    """A NATS connection that keeps what was published, with what `seen_with` says at each publish."""

    def __init__(self, seen_with=lambda: None) -> None:
        self.stats = {"reconnects": 0}
        self.published: list[tuple[dict, object]] = []
        self.seen_with = seen_with

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self.published.append((json.loads(data), self.seen_with()))

    def types(self) -> list[str]:
        return [frame["type"] for frame, _ in self.published]


def done() -> DoneFrame:
    return DoneFrame(seq=0, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1))


async def test_the_final_frame_waits_for_the_body_and_comes_after_every_other_frame():
    inbox = Inbox()
    client = ClientStream(inbox, "_INBOX.caller", resubscribe_grace_s=1.0, missing_grace_s=1.0,
                          probe_timeout_s=0.25)
    async with client.final_frame_last():
        await client.send(TokenDeltaFrame(seq=0, text="a", token_id=1))
        await client.send(done())
        assert inbox.types() == ["token_delta"]
        assert client.final_code is None  # counted when it goes out
    assert inbox.types() == ["token_delta", "done"]
    assert [frame["seq"] for frame, _ in inbox.published] == [0, 1]
    assert client.final_code == "ok"

    with pytest.raises(RuntimeError):
        async with client.final_frame_last():
            await client.send(ErrorFrame(seq=0, code="overloaded", message="full"))
            raise RuntimeError("the body failed after its final frame")
    assert inbox.types() == ["token_delta", "done", "error"]


async def test_a_caller_sees_its_call_end_only_once_the_call_has_left_its_running_place(monkeypatch):
    orchestrator = Orchestrator(MagicMock(), HearthSettings(), node_id="orchestrator-final-last")
    orchestrator.enabled = True
    orchestrator.context = SimpleNamespace(running_calls=0)
    model = SimpleNamespace(context_length=None)

    async def get_requested(name):
        return model

    async def no_release():
        return None

    orchestrator.catalog = SimpleNamespace(get_requested=get_requested, release_freed_heap=no_release)
    monkeypatch.setattr(call_serving, "prompt_room", lambda request, model: None)

    async def admit_prompt(request, model):
        return [1, 2, 3]

    monkeypatch.setattr(call_serving, "admit_prompt", admit_prompt)

    async def run_admitted(request, model, client, caller, prompt_ids, admission):
        await client.send(TokenDeltaFrame(seq=0, text="a", token_id=1))
        await client.send(done())

    orchestrator._run_admitted = run_admitted
    inbox = Inbox(seen_with=lambda: orchestrator.queue.running)
    client = ClientStream(inbox, "_INBOX.caller", resubscribe_grace_s=1.0, missing_grace_s=1.0,
                          probe_timeout_s=0.25)
    request = ChatRequest(model="tiny", prompt="hello", max_tokens=1)
    msg = SimpleNamespace(data=request.model_dump_json().encode(), headers=None, subject="llm.chat.request")
    await orchestrator._serve_request(msg, client, "alice")
    assert [(frame["type"], running) for frame, running in inbox.published] == [("token_delta", 1), ("done", 0)]

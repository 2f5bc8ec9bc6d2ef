"""A call still running after `[orchestrator] request_deadline_s` (hearth/services/orchestrator/deadline.py) ends with
one `pipeline_aborted` frame, code `pipeline_stalled`, whose reason names the setting and its value (it used to be an
`internal_error` with an empty message, counted as one); the call's parts see, as they unwind, why they were
cancelled (a run records it in its `pipeline.aborted` event: tests/e2e/test_request_deadline.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import TokenDeltaFrame
from hearth.services.common.config import HearthSettings
from hearth.services.common.metrics import sample_value
from hearth.services.orchestrator.deadline import passed_deadline
from hearth.services.orchestrator.service import Orchestrator
from tests.orchestrator_stand_ins import admit_every_prompt

DEADLINE_S = 0.2


class Connection:
    """A NATS connection that keeps what was published (and is closed to flushes: nothing is sent again)."""

    stats = {"reconnects": 0}
    is_closed = True
    is_connected = False

    def __init__(self) -> None:
        self.frames: list[dict] = []

    def jetstream(self):
        return object()

    def new_inbox(self) -> str:
        return "_INBOX.status"

    async def subscribe(self, subject, cb=None):
        return SimpleNamespace(unsubscribe=lambda: asyncio.sleep(0))

    async def publish(self, subject: str, data: bytes, reply: str = "", headers=None) -> None:
        self.frames.append(json.loads(data))


async def test_a_call_past_its_deadline_ends_pipeline_stalled_naming_the_setting(monkeypatch):
    connection = Connection()
    settings = HearthSettings(orchestrator={"request_deadline_s": DEADLINE_S})
    orchestrator = Orchestrator(connection, settings, node_id="orchestrator-deadline")
    orchestrator.enabled = True
    orchestrator.context = SimpleNamespace(running_calls=0)

    admit_every_prompt(orchestrator, monkeypatch)
    seen_unwinding = []

    async def run_admitted(request, model, client, caller, prompt_ids, admission):
        await client.send(TokenDeltaFrame(seq=0, text="a", token_id=1))
        try:
            await asyncio.sleep(60)  # a call far slower than its deadline
        finally:
            seen_unwinding.append(passed_deadline())

    orchestrator._run_admitted = run_admitted
    request = ChatRequest(model="tiny", prompt="hello", max_tokens=1)
    msg = SimpleNamespace(data=request.model_dump_json().encode(), headers=None, subject="llm.chat.request",
                          reply="_INBOX.caller.1")
    stalled_before = sample_value("hearth_requests_total", {"code": "pipeline_stalled"}) or 0
    internal_before = sample_value("hearth_requests_total", {"code": "internal_error"}) or 0
    try:
        await asyncio.wait_for(orchestrator._serve(msg), timeout=30)
    finally:
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()

    final = [frame for frame in connection.frames if frame["type"] not in ("keepalive", "queued")]
    assert [frame["type"] for frame in final] == ["token_delta", "pipeline_aborted"]
    assert final[-1]["code"] == "pipeline_stalled"
    assert f"[orchestrator] request_deadline_s ({DEADLINE_S:g} s)" in final[-1]["reason"]
    assert [deadline.deadline_s for deadline in seen_unwinding] == [DEADLINE_S]
    assert sample_value("hearth_requests_total", {"code": "pipeline_stalled"}) == stalled_before + 1
    assert (sample_value("hearth_requests_total", {"code": "internal_error"}) or 0) == internal_before


async def test_outside_a_call_no_deadline_has_passed():
    assert passed_deadline() is None

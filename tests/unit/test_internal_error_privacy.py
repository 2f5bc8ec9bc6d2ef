"""A call that fails on an unexpected exception whose message quotes its prompt (a pydantic ValidationError echoes
the values it refused) leaves the prompt out of the orchestrator's log and out of its `internal_error` frame, which
the gateway logs: the failure is told by its type and where it was raised."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

from hearth.protocol.chat import ChatRequest
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator
from tests.orchestrator_stand_ins import admit_every_prompt
from tests.unit.test_request_deadline import Connection

MARKER = "ZQXJ-private-prompt"


async def test_an_unexpected_failure_quoting_the_prompt_is_logged_and_told_without_it(monkeypatch, caplog):
    connection = Connection()
    orchestrator = Orchestrator(connection, HearthSettings(), node_id="orchestrator-privacy")
    orchestrator.enabled = True
    orchestrator.context = SimpleNamespace(running_calls=0)
    admit_every_prompt(orchestrator, monkeypatch)

    async def run_admitted(request, model, client, caller, prompt_ids, admission):
        # A bug of the run: a field given the prompt's text, which pydantic refuses, quoting it.
        ChatRequest(model=request.model, prompt="x", max_tokens=request.prompt)

    orchestrator._run_admitted = run_admitted
    request = ChatRequest(model="tiny", prompt=f"{MARKER} what is private", max_tokens=1)
    msg = SimpleNamespace(data=request.model_dump_json().encode(), headers=None, subject="llm.chat.request",
                          reply="_INBOX.caller.1")
    caplog.set_level(logging.DEBUG)
    try:
        await asyncio.wait_for(orchestrator._serve(msg), timeout=30)
    finally:
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()

    final = [frame for frame in connection.frames if frame["type"] not in ("keepalive", "queued")]
    assert [(frame["type"], frame["code"]) for frame in final] == [("error", "internal_error")]
    assert "ValidationError" in final[0]["message"]
    assert MARKER not in json.dumps(connection.frames)
    logged = "\n".join(record.getMessage() + (record.exc_text or "") for record in caplog.records)
    assert "ValidationError" in logged and "run_admitted" in logged  # what failed, and where
    assert MARKER not in logged
    assert MARKER not in caplog.text

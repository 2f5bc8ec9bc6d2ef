"""An `llm.models` request whose answer fails to be made (the read model cannot be read) is answered with an
`internal_error` frame, as a chat request is: the asker does not wait out its timeout for nothing, and the request's
task ends without an exception nobody retrieves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.protocol.chat_frames import ErrorFrame
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator


class _Connection:
    def jetstream(self):
        return object()


class _UnreadableRouter:
    def all_candidates(self):
        raise OSError("disk I/O error")


class _Request:
    subject = "llm.models"
    reply = "_INBOX.asker.1"
    data = b""
    headers = None

    def __init__(self) -> None:
        self.answers: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(data)


async def test_a_models_answer_that_fails_is_an_internal_error_frame():
    orchestrator = Orchestrator(_Connection(), HearthSettings(), node_id="n")
    orchestrator.context = SimpleNamespace(router=_UnreadableRouter())
    request = _Request()
    try:
        await orchestrator._on_models_request(request)
        (task,) = orchestrator._tasks
        await asyncio.wait({task}, timeout=5)

        assert task.done() and task.exception() is None
        assert [ErrorFrame.model_validate_json(answer).code for answer in request.answers] == ["internal_error"]
    finally:
        orchestrator.catalog.close()
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()

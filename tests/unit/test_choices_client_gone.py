"""A request of `n` choices whose client went away ends as a single call does then (hearth/services/orchestrator/
choices.py): every choice ended `client_gone` without a final frame, and the group sends none either. It used to send
`pipeline_aborted` `internal_error` ("a choice ended without a frame") to nobody, counting the call in
hearth_requests_total as an internal error, not `client_gone`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.services.orchestrator import choices
from hearth.services.orchestrator.choices import ChoiceClient, ChoiceGroup
from hearth.services.orchestrator.client_stream import ClientStream


class _LeftRun:
    """A choice whose client stopped listening: it ends `client_gone` and, as PipelineRun, sends no final frame."""

    def __init__(self, call, ctx) -> None:
        self.call = call
        self.on_first_token = None

    async def serve(self) -> None:
        self.call.client.client_gone.set()

    async def close(self) -> None:
        pass


class _Connection:
    stats = {"reconnects": 0}

    def __init__(self) -> None:
        self.published: list[bytes] = []

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self.published.append(data)


async def test_a_choice_group_whose_client_left_sends_no_final_frame_and_is_counted_client_gone(monkeypatch):
    monkeypatch.setattr(choices, "PipelineRun", _LeftRun)
    connection = _Connection()
    client = ClientStream(connection, "_INBOX.caller", resubscribe_grace_s=1.0, missing_grace_s=1.0,
                          probe_timeout_s=0.25)
    group = ChoiceGroup(client, ctx=None)
    calls = [SimpleNamespace(pipeline_id=f"p{index}", client=ChoiceClient(group, index), quantization=None)
             for index in range(3)]

    await asyncio.wait_for(group.serve(calls), timeout=10)

    assert connection.published == []
    assert client.final_code is None and client.client_gone.is_set()  # count_request counts it client_gone

"""ChoiceGroup leaves no task behind: its wait for the first choice's prefill ends with the group, however the first
choice ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.protocol.chat_frames import ErrorFrame
from hearth.services.orchestrator import choices
from hearth.services.orchestrator.choices import ChoiceClient, ChoiceGroup
from tests.orchestrator_stand_ins import RecordingClient


class _FailingRun:
    """A choice that ends with an error frame before any token (its hops refused it, say)."""

    def __init__(self, call, ctx) -> None:
        self.call = call
        self.on_first_token = None

    async def serve(self) -> None:
        await self.call.client.send(ErrorFrame(seq=0, code="shard_unavailable", message="no shard"))

    async def close(self) -> None:
        pass


async def test_a_first_choice_failing_before_its_first_token_leaves_no_task_pending(monkeypatch):
    monkeypatch.setattr(choices, "PipelineRun", _FailingRun)
    client = RecordingClient()
    group = ChoiceGroup(client, ctx=None)
    calls = [SimpleNamespace(pipeline_id=f"p{index}", client=ChoiceClient(group, index), quantization=None)
             for index in range(2)]
    before = asyncio.all_tasks()

    await group.serve(calls)

    left = [task for task in asyncio.all_tasks() - before if not task.done()]
    assert left == []
    assert client.sent[-1].code == "shard_unavailable"

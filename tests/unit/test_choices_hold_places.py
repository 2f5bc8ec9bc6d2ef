"""A request's `n` choices are pipelines, each held to a running place (hearth/services/orchestrator/queue.py
`FairQueue.place(pipelines=n)`, choices.py): the request holds one place per choice up to its caller's share, and runs
as many choices at once as it holds places, the others starting as those end. It used to hold one place whatever `n`
was, so a member with n = 8 ran 8 pipelines for each place of its share, and other members' calls, admitted by the
queue, found the shards full."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest.mock import MagicMock

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import DoneFrame, Usage
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator import choices
from hearth.services.orchestrator.choices import ChoiceClient, ChoiceGroup
from hearth.services.orchestrator.client_stream import ClientStream
from hearth.services.orchestrator.service import Orchestrator
from tests.orchestrator_stand_ins import RecordingClient, admit_every_prompt


class _CountedRun:
    """A choice that gives its first token, then runs a while; counts the choices running at once."""

    running = 0
    most = 0

    def __init__(self, call, ctx) -> None:
        self.call = call
        self.on_first_token = None

    async def serve(self) -> None:
        cls = type(self)
        cls.running += 1
        cls.most = max(cls.most, cls.running)
        try:
            if self.on_first_token is not None:
                await self.on_first_token(self)
            await asyncio.sleep(0.01)
            await self.call.client.send(DoneFrame(seq=0, finish_reason="length",
                                                  usage=Usage(prompt_tokens=1, completion_tokens=1)))
        finally:
            cls.running -= 1

    async def close(self) -> None:
        pass


async def test_a_group_runs_as_many_choices_at_once_as_it_holds_places(monkeypatch):
    monkeypatch.setattr(choices, "PipelineRun", _CountedRun)
    monkeypatch.setattr(ChoiceGroup, "_share_prefill", lambda self, run: _prefilled(self))
    client = RecordingClient()
    group = ChoiceGroup(client, ctx=None, at_once=2)
    calls = [SimpleNamespace(pipeline_id=f"p{index}", client=ChoiceClient(group, index), quantization=None)
             for index in range(5)]

    await asyncio.wait_for(group.serve(calls), timeout=10)

    assert _CountedRun.most == 2
    assert client.sent[-1].type == "done" and [end.choice for end in client.sent[-1].choices] == list(range(5))


async def _prefilled(group: ChoiceGroup) -> None:
    group._prefilled.set()


async def test_a_request_of_n_choices_holds_a_running_place_for_each_within_its_callers_share(monkeypatch):
    orchestrator = Orchestrator(MagicMock(), HearthSettings(), node_id="orchestrator-choices")  # 4 places, 3 a member
    orchestrator.enabled = True
    orchestrator.context = SimpleNamespace(running_calls=0)

    admit_every_prompt(orchestrator, monkeypatch)
    held = []

    async def run_admitted(request, model, client, caller, prompt_ids, admission):
        held.append((request.n, admission.places, orchestrator.queue.running))

    orchestrator._run_admitted = run_admitted
    client = ClientStream(SimpleNamespace(stats={"reconnects": 0}), "_INBOX.caller", resubscribe_grace_s=1.0,
                          missing_grace_s=1.0, probe_timeout_s=0.25)
    for n in (1, 2, 8):
        request = ChatRequest(model="tiny", prompt="hello", max_tokens=1, n=n)
        msg = SimpleNamespace(data=request.model_dump_json().encode(), headers=None, subject="llm.chat.request")
        await orchestrator._serve_request(msg, client, "alice")
    assert held == [(1, 1, 1), (2, 2, 2), (8, 3, 3)]
    assert orchestrator.queue.running == 0
    orchestrator.catalog = SimpleNamespace(close=lambda: None)
    if orchestrator._tmp_dir is not None:
        orchestrator._tmp_dir.cleanup()

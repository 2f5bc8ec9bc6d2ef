"""A queued call whose client left before its turn never runs (hearth/services/orchestrator/queue.py, "a call's
turn"): over a real nats-server, a scripted client subscribes its inbox, calls, and unsubscribes while its call
waits for the one running place. When the place frees, the orchestrator finds nobody on that inbox ("no
responders"): the place goes to the next call at once, the left call opens no session and, once
`[orchestrator] client_missing_grace_s` is over, leaves the queue counted `client_gone`. Before, it was admitted
and ran (opening its hops' sessions) until the grace caught it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import DoneFrame, Usage
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import close_quietly, connect_nats, flush_ordered
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.metrics import CLIENT_GONE, requests_total
from hearth.services.orchestrator.service import Orchestrator
from tests.orchestrator_stand_ins import admit_every_prompt

pytestmark = pytest.mark.timeout(60)

missing_grace_s = 1.0
wait_s = 20.0


async def frames_until(inbox_frames: asyncio.Queue, kind: str) -> None:
    async with asyncio.timeout(wait_s):
        while (await inbox_frames.get())["type"] != kind:
            pass


async def test_a_queued_call_whose_client_unsubscribed_never_runs(nats_server, monkeypatch):
    orchestrator_nc = await connect_nats(nats_server.url, name="orchestrator")
    caller = await connect_nats(nats_server.url, name="caller")
    settings = HearthSettings(research={"distributed_inference": {"max_concurrent_pipelines": 1}},
                              orchestrator={"client_missing_grace_s": missing_grace_s})
    orchestrator = Orchestrator(orchestrator_nc, settings, node_id="orchestrator-queued-left")
    orchestrator.enabled = True
    orchestrator.context = SimpleNamespace(running_calls=0)
    admit_every_prompt(orchestrator, monkeypatch)
    ran: list[str] = []
    first_may_end = asyncio.Event()

    async def run_admitted(request, model, client, caller_name, prompt_ids, admission):
        ran.append(request.request_id)  # where a real call opens its hops' sessions
        if request.request_id == "first":
            async with asyncio.timeout(wait_s):
                await first_may_end.wait()
        await client.send(DoneFrame(seq=0, finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=1)))

    orchestrator._run_admitted = run_admitted
    gone_before = requests_total.labels(CLIENT_GONE)._value.get()
    inboxes: dict[str, asyncio.Queue] = {}
    subscriptions = {}
    serving = []

    async def call(request_id: str) -> None:
        inbox = caller.new_inbox()
        inboxes[request_id] = asyncio.Queue()
        frames = inboxes[request_id]

        async def heard(msg) -> None:
            await frames.put(json.loads(msg.data))

        subscriptions[request_id] = await caller.subscribe(inbox, cb=heard)
        await flush_ordered(caller)
        payload = ChatRequest(model="tiny", prompt="hello", max_tokens=1, request_id=request_id).model_dump_json()
        serving.append(asyncio.create_task(orchestrator._serve(SimpleNamespace(
            data=payload.encode(), headers=None, subject=CHAT_REQUEST_SUBJECT, reply=inbox))))

    try:
        await call("first")
        await call("left")
        await frames_until(inboxes["left"], "queued")
        await call("next")
        await frames_until(inboxes["next"], "queued")
        await subscriptions["left"].unsubscribe()  # its client leaves while its call waits
        await flush_ordered(caller)
        first_may_end.set()
        await frames_until(inboxes["next"], "done")
        async with asyncio.timeout(wait_s):
            await asyncio.gather(*serving)
    finally:
        first_may_end.set()
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        await close_quietly(caller)
        await close_quietly(orchestrator_nc)
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()

    assert ran == ["first", "next"]  # the left call never ran, and did not hold back the one after it
    assert requests_total.labels(CLIENT_GONE)._value.get() == gone_before + 1
    assert orchestrator.queue.running == 0 and orchestrator.queue.queued == 0

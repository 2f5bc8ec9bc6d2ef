"""A member's share of an orchestrator counts its calls from their arrival (hearth/services/orchestrator/queue.py
`FairQueue.arrive`): while a call's model head loads, or anything else before the queue, its calls are not yet
waiting in the queue, and before they were counted a member could have any number of calls held there (each with
its request, an inbox watch and keepalives) and take over the queue at once when the head came. Now one beyond its
running share plus `max_queued_per_caller` is answered `overloaded` at once, another member's call still gets in,
and the share is whole again once the calls end, however they end."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from types import SimpleNamespace

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import DoneFrame, Usage
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator
from tests.orchestrator_stand_ins import admit_every_prompt


class Connection:
    """A NATS connection that keeps what was published to each inbox (closed to flushes: nothing is sent again)."""

    stats = {"reconnects": 0}
    is_closed = True
    is_connected = False

    def __init__(self) -> None:
        self.frames: dict[str, list[dict]] = defaultdict(list)
        self.fail_subscribe = False
        self.seen_with = lambda: None
        self.seen: list[tuple[str, object]] = []

    def jetstream(self):
        return object()

    def new_inbox(self) -> str:
        return "_INBOX.status"

    async def subscribe(self, subject, cb=None):
        if self.fail_subscribe:
            raise ConnectionError("the broker connection is closed")
        return SimpleNamespace(unsubscribe=lambda: asyncio.sleep(0))

    async def publish(self, subject: str, data: bytes, reply: str = "", headers=None) -> None:
        self.frames[subject].append(json.loads(data))
        self.seen.append((self.frames[subject][-1]["type"], self.seen_with()))

    def finals(self, inbox: str) -> list[dict]:
        return [frame for frame in self.frames[inbox] if frame["type"] not in ("keepalive", "queued")]


def orchestrator_loading_a_head(monkeypatch, connection: Connection, head_loaded: asyncio.Event) -> Orchestrator:
    settings = HearthSettings(orchestrator={"max_queued_per_caller": 2, "max_streams_per_caller": 1,
                                            "max_queued_requests": 100})
    orchestrator = Orchestrator(connection, settings, node_id="orchestrator-arrivals")
    orchestrator.enabled = True
    orchestrator.context = SimpleNamespace(running_calls=0)
    orchestrator.call_verifier = SimpleNamespace(
        check=lambda subject, reply, data, headers: SimpleNamespace(name=reply.split(".")[1]),
        role_of=lambda name: "client")

    async def get_requested(name):
        await asyncio.wait_for(head_loaded.wait(), timeout=30)  # the model's head is loading
        return SimpleNamespace(context_length=None)

    admit_every_prompt(orchestrator, monkeypatch, get_requested)

    async def run_admitted(request, model, client, caller, prompt_ids, admission):
        await client.send(DoneFrame(seq=0, finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=1)))

    orchestrator._run_admitted = run_admitted
    return orchestrator


def message(caller: str, index: int) -> SimpleNamespace:
    request = ChatRequest(model="tiny", prompt="hello", max_tokens=1)
    return SimpleNamespace(data=request.model_dump_json().encode(), headers=None, subject="llm.chat.request",
                           reply=f"_INBOX.{caller}.{index}")


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_member_holds_at_most_its_share_of_calls_while_a_head_loads(monkeypatch):
    connection, head_loaded = Connection(), asyncio.Event()
    orchestrator = orchestrator_loading_a_head(monkeypatch, connection, head_loaded)
    try:
        flood = [asyncio.create_task(orchestrator._serve(message("alice", index))) for index in range(20)]
        await settle()
        refused = [index for index in range(20) if connection.finals(f"_INBOX.alice.{index}")]
        # Its running share (1) and its share of the queue (2) are held; the rest is refused at once.
        assert len(refused) == 17
        assert all(connection.finals(f"_INBOX.alice.{index}")[0]["code"] == "overloaded"
                   and connection.finals(f"_INBOX.alice.{index}")[0]["retry_after_s"] == 5.0 for index in refused)
        other = asyncio.create_task(orchestrator._serve(message("bob", 0)))
        await settle()
        assert connection.finals("_INBOX.bob.0") == []  # another member's call is held, not refused
        head_loaded.set()
        await asyncio.wait_for(asyncio.gather(*flood, other), timeout=30)
        served = [index for index in range(20) if index not in refused]
        assert [connection.finals(f"_INBOX.alice.{index}")[0]["type"] for index in served] == ["done"] * 3
        assert connection.finals("_INBOX.bob.0")[0]["type"] == "done"
        # Every call ended: the member's whole share is free again.
        again = [asyncio.create_task(orchestrator._serve(message("alice", 100 + index))) for index in range(3)]
        await asyncio.wait_for(asyncio.gather(*again), timeout=30)
        assert [connection.finals(f"_INBOX.alice.{100 + index}")[0]["type"] for index in range(3)] == ["done"] * 3
    finally:
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()


async def test_a_call_that_fails_before_the_queue_gives_its_place_back(monkeypatch):
    connection, head_loaded = Connection(), asyncio.Event()
    head_loaded.set()
    orchestrator = orchestrator_loading_a_head(monkeypatch, connection, head_loaded)
    try:
        connection.fail_subscribe = True  # the broker is away: the calls cannot even watch their client's inbox
        for index in range(5):
            try:
                await asyncio.wait_for(orchestrator._serve(message("alice", index)), timeout=30)
            except ConnectionError:
                pass
        connection.fail_subscribe = False
        await asyncio.wait_for(orchestrator._serve(message("alice", 10)), timeout=30)
        assert connection.finals("_INBOX.alice.10")[0]["type"] == "done"
    finally:
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()


async def test_a_caller_that_saw_its_call_end_may_call_again_at_once_within_its_whole_share(monkeypatch):
    connection, head_loaded = Connection(), asyncio.Event()
    head_loaded.set()
    orchestrator = orchestrator_loading_a_head(monkeypatch, connection, head_loaded)
    connection.seen_with = lambda: dict(orchestrator.queue._arrived)
    try:
        await asyncio.wait_for(orchestrator._serve(message("alice", 0)), timeout=30)
        # When its done frame went out, the call no longer counted in alice's share (the frame is what lets her
        # send the next: a burst sent on it must find her whole share).
        assert [(kind, held) for kind, held in connection.seen if kind == "done"] == [("done", {})]
    finally:
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()

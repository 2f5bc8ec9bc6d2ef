"""Frames a caller missed while the broker went away reach it all the same (hearth/services/orchestrator/
client_stream.py, hearth/services/client/chat.py): a real nats-server restarts mid-call; the orchestrator's
connection is back long before the caller's, so the frames it sends meanwhile find nobody on the caller's inbox
("no responders"). Once the caller resubscribed they are sent again, and the caller sees every frame once, in
order, and the call's end. A caller that leaves for good is still noticed once the grace after a reconnect is over.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from hearth.protocol.chat import ChatRequest, DoneFrame, TokenDeltaFrame, Usage
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import connect_nats
from hearth.services.client.chat import stream_chat_raw
from hearth.services.common.config import NatsSettings
from hearth.services.orchestrator.client_stream import ClientStream

pytestmark = pytest.mark.timeout(60)

TOKENS = 40
token_interval_s = 0.05
# The caller's connection waits this long before trying the restarted server again; the orchestrator's much less.
caller_reconnect_wait_s = 1.5
orchestrator_reconnect_wait_s = 0.05
server_down_s = 0.3
grace_s = 5.0
probe_timeout_s = 0.5
call_timeout_s = 30.0


async def serve_one_call(orchestrator, calls: asyncio.Queue, restart_after_tokens: int, restart) -> ClientStream:
    """Answer the first call with TOKENS token frames and `done`, restarting the broker after some of them."""
    request = await asyncio.wait_for(calls.get(), timeout=call_timeout_s)
    client = await ClientStream(orchestrator, request.reply, resubscribe_grace_s=grace_s,
                                probe_timeout_s=probe_timeout_s).start()
    try:
        for index in range(TOKENS):
            if index == restart_after_tokens:
                await asyncio.to_thread(restart)
            await client.send(TokenDeltaFrame(seq=0, text=f" t{index}", token_id=index))
            await asyncio.sleep(token_interval_s)
        await client.send(DoneFrame(seq=0, finish_reason="length",
                                    usage=Usage(prompt_tokens=1, completion_tokens=TOKENS)))
        await client.settle()
    finally:
        await client.close()
    return client


async def test_frames_sent_while_the_caller_reconnects_are_sent_again_in_order(nats_server):
    orchestrator = await connect_nats(nats_server.url, name="orchestrator",
                                      settings=NatsSettings(reconnect_wait_s=orchestrator_reconnect_wait_s))
    caller = await connect_nats(nats_server.url, name="caller",
                                settings=NatsSettings(reconnect_wait_s=caller_reconnect_wait_s))
    calls: asyncio.Queue = asyncio.Queue()
    await orchestrator.subscribe(CHAT_REQUEST_SUBJECT, cb=calls.put)
    await orchestrator.flush()

    def restart() -> None:
        nats_server.stop()
        time.sleep(server_down_s)
        nats_server.start()

    try:
        serving = asyncio.create_task(serve_one_call(orchestrator, calls, 5, restart))
        payload = ChatRequest(prompt="hello", max_tokens=TOKENS).model_dump_json().encode()
        frames = [frame async for frame in stream_chat_raw(caller, payload, frame_gap_timeout=call_timeout_s)]
        stream = await asyncio.wait_for(serving, timeout=call_timeout_s)
    finally:
        await orchestrator.close()
        await caller.close()

    assert caller.stats["reconnects"] == 1 and orchestrator.stats["reconnects"] == 1
    assert stream.frames_sent_again > 0  # the caller did miss frames: they came again
    assert [frame.seq for frame in frames] == list(range(TOKENS + 1))
    assert [frame.token_id for frame in frames[:-1]] == list(range(TOKENS))
    assert frames[-1].type == "done"


async def test_a_caller_that_does_not_come_back_is_gone_once_the_grace_is_over(nats_server):
    short_grace_s = 1.0
    orchestrator = await connect_nats(nats_server.url, name="orchestrator",
                                      settings=NatsSettings(reconnect_wait_s=orchestrator_reconnect_wait_s))
    caller = await connect_nats(nats_server.url, name="caller")
    inbox = caller.new_inbox()
    await caller.subscribe(inbox)
    await caller.flush()
    client = await ClientStream(orchestrator, inbox, resubscribe_grace_s=short_grace_s,
                                probe_timeout_s=probe_timeout_s).start()
    try:
        await client.send(TokenDeltaFrame(seq=0, text=" t0", token_id=0))
        await asyncio.to_thread(nats_server.stop)
        await caller.close()  # it leaves while the broker is away: nobody resubscribes its inbox
        await asyncio.to_thread(nats_server.start)
        await asyncio.wait_for(orchestrator.flush(), timeout=call_timeout_s)  # our connection is back
        first_send_after = time.monotonic()
        deadline = first_send_after + call_timeout_s
        while not client.client_gone.is_set() and time.monotonic() < deadline:
            await client.send(TokenDeltaFrame(seq=0, text=" t", token_id=1))
            await asyncio.sleep(token_interval_s)
        gone_after_s = time.monotonic() - first_send_after
    finally:
        await client.close()
        await orchestrator.close()

    assert client.client_gone.is_set()
    assert gone_after_s >= short_grace_s  # "no responders" within the grace was waited out
    assert client.frames_sent_again == 0  # nobody to send them to

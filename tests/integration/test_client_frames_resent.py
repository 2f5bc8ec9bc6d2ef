"""Frames a caller missed while the broker went away reach it all the same (hearth/services/orchestrator/
client_stream.py, hearth/services/client/chat.py), over a real nats-server: when it restarts mid-call (the
orchestrator's connection is back long before the caller's), and when only the caller's connection is cut for a
while (its broker node went away), the frames sent meanwhile find nobody on the caller's inbox ("no responders").
Once the caller resubscribed they are sent again, and the caller sees every frame once, in order, and the call's
end. A caller that leaves for good is still noticed once the grace is over, and one whose own connection stays
down ends its call `pipeline_stalled` once it waited `[orchestrator] broker_wait_s` for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame, Usage
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import close_quietly, connect_nats, flush_ordered
from hearth.services.client.chat import stream_chat_raw
from hearth.services.common.config import NatsSettings
from hearth.services.orchestrator.client_stream import ClientStream

pytestmark = pytest.mark.timeout(60)

TOKENS = 40
disturb_after_tokens = 5
token_interval_s = 0.05
# The caller's connection waits this long before trying the restarted server again; the orchestrator's much less.
caller_reconnect_wait_s = 1.5
orchestrator_reconnect_wait_s = 0.05
server_down_s = 0.3
link_down_s = 0.6
grace_s = 5.0
probe_timeout_s = 0.5
call_timeout_s = 30.0


async def serve_one_call(orchestrator, calls: asyncio.Queue, disturb: Callable[[], Awaitable[None]]) -> ClientStream:
    """Answer the first call with TOKENS token frames and `done`, `disturb` starting after a few of them."""
    request = await asyncio.wait_for(calls.get(), timeout=call_timeout_s)
    client = await ClientStream(orchestrator, request.reply, resubscribe_grace_s=grace_s, missing_grace_s=grace_s,
                                probe_timeout_s=probe_timeout_s).start()
    disturbance = None
    try:
        for index in range(TOKENS):
            if index == disturb_after_tokens:
                disturbance = asyncio.create_task(disturb())
            await client.send(TokenDeltaFrame(seq=0, text=f" t{index}", token_id=index))
            await asyncio.sleep(token_interval_s)
        await client.send(DoneFrame(seq=0, finish_reason="length",
                                    usage=Usage(prompt_tokens=1, completion_tokens=TOKENS)))
        await client.settle()
        await asyncio.wait_for(disturbance, timeout=call_timeout_s)
    finally:
        await client.close()
    return client


async def one_call(orchestrator, caller, disturb: Callable[[], Awaitable[None]]) -> tuple[list, ClientStream]:
    """The frames `caller` saw of one call `orchestrator` answered while `disturb` ran, and the call's stream."""
    calls: asyncio.Queue = asyncio.Queue()
    await orchestrator.subscribe(CHAT_REQUEST_SUBJECT, cb=calls.put)
    await flush_ordered(orchestrator)
    serving = asyncio.create_task(serve_one_call(orchestrator, calls, disturb))
    payload = ChatRequest(prompt="hello", max_tokens=TOKENS).model_dump_json().encode()
    frames = [frame async for frame in stream_chat_raw(caller, payload, frame_gap_timeout=call_timeout_s)]
    return frames, await asyncio.wait_for(serving, timeout=call_timeout_s)


def assert_every_frame_once_in_order(frames: list) -> None:
    assert [frame.seq for frame in frames] == list(range(TOKENS + 1))
    assert [frame.token_id for frame in frames[:-1]] == list(range(TOKENS))
    assert frames[-1].type == "done"


async def test_frames_sent_while_the_caller_reconnects_are_sent_again_in_order(nats_server):
    orchestrator = await connect_nats(nats_server.url, name="orchestrator",
                                      settings=NatsSettings(reconnect_wait_s=orchestrator_reconnect_wait_s))
    caller = await connect_nats(nats_server.url, name="caller",
                                settings=NatsSettings(reconnect_wait_s=caller_reconnect_wait_s))

    async def restart() -> None:
        await asyncio.to_thread(nats_server.stop)
        await asyncio.sleep(server_down_s)
        await asyncio.to_thread(nats_server.start)

    try:
        frames, stream = await one_call(orchestrator, caller, restart)
    finally:
        await close_quietly(orchestrator)
        await close_quietly(caller)

    assert caller.stats["reconnects"] == 1 and orchestrator.stats["reconnects"] == 1
    assert stream.frames_sent_again > 0  # the caller did miss frames: they came again
    assert_every_frame_once_in_order(frames)


class CuttableLink:
    """A TCP relay between the caller and nats-server that can cut its connections and refuse new ones for a
    while: to the broker, the caller's connection ends as if its node had gone away."""

    def __init__(self, server_host: str, server_port: int) -> None:
        self.server = (server_host, server_port)
        self.down = False
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task] = set()
        self._relay: asyncio.Server | None = None

    async def start(self) -> str:
        self._relay = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._relay.sockets[0].getsockname()[1]}"

    async def cut_for(self, seconds: float) -> None:
        self.down = True
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await asyncio.sleep(seconds)
        self.down = False

    async def close(self) -> None:
        self._relay.close()
        for writer in self._writers:
            writer.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.close()
            return
        server_reader, server_writer = await asyncio.open_connection(*self.server)
        self._writers += [writer, server_writer]
        for source, sink in ((reader, server_writer), (server_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


async def test_frames_sent_while_only_the_caller_is_cut_off_are_sent_again_in_order(nats_server):
    link = CuttableLink(nats_server.host, nats_server.port)
    link_url = await link.start()
    orchestrator = await connect_nats(nats_server.url, name="orchestrator")
    caller = await connect_nats(link_url, name="caller", settings=NatsSettings(reconnect_wait_s=0.1))
    try:
        frames, stream = await one_call(orchestrator, caller, lambda: link.cut_for(link_down_s))
    finally:
        await close_quietly(orchestrator)
        await close_quietly(caller)
        await link.close()

    assert caller.stats["reconnects"] == 1 and orchestrator.stats["reconnects"] == 0
    assert not stream.client_gone.is_set() and stream.frames_sent_again > 0
    assert_every_frame_once_in_order(frames)


async def test_a_caller_that_does_not_come_back_is_gone_once_the_grace_is_over(nats_server):
    short_grace_s = 1.0
    orchestrator = await connect_nats(nats_server.url, name="orchestrator",
                                      settings=NatsSettings(reconnect_wait_s=orchestrator_reconnect_wait_s))
    caller = await connect_nats(nats_server.url, name="caller")
    inbox = caller.new_inbox()
    await caller.subscribe(inbox)
    await flush_ordered(caller)
    client = await ClientStream(orchestrator, inbox, resubscribe_grace_s=short_grace_s,
                                missing_grace_s=short_grace_s, probe_timeout_s=probe_timeout_s).start()
    try:
        await client.send(TokenDeltaFrame(seq=0, text=" t0", token_id=0))
        await asyncio.to_thread(nats_server.stop)
        await close_quietly(caller)  # it leaves while the broker is away: nobody resubscribes its inbox
        await asyncio.to_thread(nats_server.start)
        await flush_ordered(orchestrator, call_timeout_s)  # our connection is back
        first_send_after = time.monotonic()
        deadline = first_send_after + call_timeout_s
        while not client.client_gone.is_set() and time.monotonic() < deadline:
            await client.send(TokenDeltaFrame(seq=0, text=" t", token_id=1))
            await asyncio.sleep(token_interval_s)
        gone_after_s = time.monotonic() - first_send_after
    finally:
        await client.close()
        await close_quietly(orchestrator)

    assert client.client_gone.is_set()
    assert gone_after_s >= short_grace_s  # "no responders" within the grace was waited out
    assert client.frames_sent_again == 0  # nobody to send them to


async def test_a_caller_cut_off_for_longer_than_broker_wait_s_ends_pipeline_stalled(nats_server):
    """The caller waited without any bound while its own connection was down: a gateway's HTTP client got nothing
    until the broker came back, however long."""
    link = CuttableLink(nats_server.host, nats_server.port)
    link_url = await link.start()
    orchestrator = await connect_nats(nats_server.url, name="orchestrator")
    caller = await connect_nats(link_url, name="caller", settings=NatsSettings(reconnect_wait_s=0.1))

    async def answer(msg) -> None:
        await orchestrator.publish(msg.reply, TokenDeltaFrame(seq=0, text=" t0", token_id=0).model_dump_json().encode())

    await orchestrator.subscribe(CHAT_REQUEST_SUBJECT, cb=answer)
    await flush_ordered(orchestrator)
    payload = ChatRequest(prompt="hello", max_tokens=TOKENS).model_dump_json().encode()
    frames, cut = [], None

    async def read_the_call() -> None:
        nonlocal cut
        async for frame in stream_chat_raw(caller, payload, frame_gap_timeout=0.2, broker_wait=1.0):
            frames.append(frame)
            if cut is None:  # the first token is in: the caller's link goes down for longer than the test
                cut = asyncio.create_task(link.cut_for(call_timeout_s))

    try:
        await asyncio.wait_for(read_the_call(), timeout=call_timeout_s / 2)
        still_cut = link.down
    finally:
        if cut is not None:
            cut.cancel()
        await close_quietly(orchestrator)
        await close_quietly(caller)
        await link.close()

    assert still_cut  # it ended while its connection was down, not once it came back
    assert [frame.type for frame in frames] == ["token_delta", "error"]
    assert frames[-1].code == "pipeline_stalled" and "broker_wait_s" in frames[-1].message

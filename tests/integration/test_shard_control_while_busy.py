"""A shard answers `open` at once while its compute thread is busy: closing another pipeline's hop waits for the
compute thread (its cache reset queues behind the step in progress), but it does so outside the lock that
serialises hop changes, so the `open` of the next call is not refused as `shard_unavailable` meanwhile
(hearth/services/shard/server.py; the cause of a refusal seen once in the interleave bench)."""

from __future__ import annotations

import asyncio
import threading

from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import CloseHop, ControlReply, OpenHop
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

control_reply_timeout_s = 5.0


async def until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def open_request(pipeline_id: str, layer_hi: int) -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id=f"{pipeline_id}-session", hop=0, hop_count=1,
                   model_id="tiny", weights_sha256="0" * 64, layer_lo=0, layer_hi=layer_hi,
                   max_session_tokens=CONTEXT).model_dump_json().encode()


async def test_an_open_is_answered_while_a_closing_hop_waits_for_the_compute_thread(nats_server):
    compute_thread_held = threading.Event()
    blocker = None
    async with tiny_shard_server(nats_server.url) as shard:
        server, client, subject = shard.server, shard.client, shard.subject
        try:
            first = await client.request(subject, open_request("pipeline-a", 1), timeout=control_reply_timeout_s)
            opened = ControlReply.model_validate_json(first.data)
            assert opened.ok and opened.replay_steps  # the hop takes re-prefills' replay steps
            # The compute thread is busy (a long prefill step, say): pipeline-a's cache reset will queue behind it.
            blocker = asyncio.ensure_future(on_compute_thread(compute_thread_held.wait, 60.0))
            closing = asyncio.ensure_future(client.request(
                subject, CloseHop(pipeline_id="pipeline-a").model_dump_json().encode(), timeout=60.0))
            await until(lambda: server.active_streams == 0)  # the shard has taken the close up (and is in it)
            second = await client.request(subject, open_request("pipeline-b", 1), timeout=control_reply_timeout_s)
            assert ControlReply.model_validate_json(second.data).ok
            assert not closing.done(), "the close should still be waiting for the compute thread"
            assert server.active_streams == 1  # pipeline-a no longer counts, pipeline-b does
            compute_thread_held.set()
            assert ControlReply.model_validate_json((await closing).data).ok
        finally:
            compute_thread_held.set()
            if blocker is not None:
                await blocker

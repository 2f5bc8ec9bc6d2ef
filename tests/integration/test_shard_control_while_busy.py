"""A shard answers `open` at once while its compute thread is busy: closing another pipeline's hop waits for the
compute thread (its cache reset queues behind the step in progress), but it does so outside the lock that
serialises hop changes, so the `open` of the next call is not refused as `shard_unavailable` meanwhile
(hearth/services/shard/server.py; the cause of a refusal seen once in the interleave bench)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from hearth.protocol.subjects import shard_control_subject
from hearth.inference import load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.compute_thread import on_compute_thread
from hearth.services.common.config import load_settings
from hearth.protocol.control import CloseHop, ControlReply, OpenHop
from hearth.services.broker.connection import connect_nats
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.server import ShardIdentity, ShardServer

MODEL = Path(__file__).resolve().parents[2] / "models" / "hearth-tiny-llama"
control_reply_timeout_s = 5.0


async def until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def open_request(pipeline_id: str, layer_hi: int) -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id=f"{pipeline_id}-session", hop=0, hop_count=1,
                   model_id="tiny", weights_sha256="0" * 64, layer_lo=0, layer_hi=layer_hi).model_dump_json().encode()


async def test_an_open_is_answered_while_a_closing_hop_waits_for_the_compute_thread(nats_server):
    runner = await on_compute_thread(load_layer_range, MODEL, 0, 1, **RUNNER_KV_LIMITS)
    settings = load_settings()
    nc = await connect_nats(nats_server.url, name="shard-under-test", settings=settings.nats)
    client = await connect_nats(nats_server.url, name="orchestrator-stand-in", settings=settings.nats)
    subject = shard_control_subject("node0", "tiny-0-1")
    server = ShardServer(nc, ShardCompute(runner, "tiny-0-1", settings.shard), ShardIdentity(
        shard_id="tiny-0-1", model_id="tiny", node_id="node0", weights_sha256="0" * 64, layer_lo=0, layer_hi=1,
        total_layers=runner.info.num_layers, dtype="float32", memory_required_mb=1.0, control_subject=subject),
        settings)
    compute_thread_held = threading.Event()
    blocker = None
    try:
        await server.start()
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
        await server.stop()
        await client.close()
        await nc.close()
        runner.close()

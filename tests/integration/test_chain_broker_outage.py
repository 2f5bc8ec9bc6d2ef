"""HopChain across an outage of the orchestrator's broker connection: a publish the client cannot buffer, and a step
sent before a reconnect, are `broker` failures (the call rebuilds once the broker is back), never an exception out of
the call's loop nor a healthy hop blamed."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from hearth.protocol.control import ControlReply, ShardStat
from hearth.services.broker.connection import connect_nats, flush_ordered, pending_buffer_bytes
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind

HIDDEN = 1024
CHUNK_BYTES = 1024 * 1024
# A window wide enough that nothing waits for acks: the client buffers every chunk while it reconnects.
TRANSPORT = TransportSettings(window_chunks=4096, chunk_bytes=CHUNK_BYTES, step_timeout_s=5.0, control_timeout_s=2.0)


async def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_a_step_the_client_cannot_buffer_while_the_broker_is_away_is_a_broker_failure(nats_server):
    orchestrator = await connect_nats(nats_server.url, name="test-orchestrator")
    shard = await connect_nats(nats_server.url, name="test-shard")
    hop = Hop(shard_id="s0", control_subject="test.control.s0", node_id="n0", layer_lo_to_run=0, layer_hi_to_run=0)

    async def open_ok(msg) -> None:
        await shard.publish(msg.reply, ControlReply(ok=True).model_dump_json().encode())

    await shard.subscribe(hop.control_subject, cb=open_ok)
    await flush_ordered(shard)
    chain = HopChain(orchestrator, "p-broker-away", [hop], node_id="orch", model_id="m", weights_sha256="0" * 64,
                     transport=TRANSPORT, wire_dtype="fp32")
    try:
        assert await chain.open() is None
        await asyncio.to_thread(nats_server.stop)
        await _wait_until(lambda: not orchestrator.is_connected)
        # More than the client's whole reconnect buffer in one step.
        tokens = pending_buffer_bytes // (HIDDEN * 4) + 256
        hidden = torch.zeros(1, tokens, HIDDEN)
        sent = await chain.send_step(FrameKind.prefill, 0, hidden, prompt_tokens=tokens)
        assert isinstance(sent, StepFailure), sent
        assert sent.kind == "broker" and sent.shard_id is None, sent
    finally:
        await chain.close()
        for connection in (orchestrator, shard):
            with contextlib.suppress(Exception):  # closing a connection that is still reconnecting may fail
                await connection.close()


async def test_a_step_sent_before_a_reconnect_is_a_broker_failure_when_awaited_after_it(nats_server):
    """Chunked prefill sends a chunk, then awaits the chunks before it: whatever the hops answered while our connection
    was away (acks, the output) is lost. Before, the wait took its epoch when it began, after the reconnect, and so
    waited out the step timeout and blamed a healthy hop (kept out of every call's routing for a while)."""
    orchestrator = await connect_nats(nats_server.url, name="test-orchestrator")
    shard = await connect_nats(nats_server.url, name="test-shard")
    hop = Hop(shard_id="s0", control_subject="test.control.s1", node_id="n0", layer_lo_to_run=0, layer_hi_to_run=0)

    async def answer(msg) -> None:  # opens, and answers every probe: alive, its answers lost with our connection
        reply = ShardStat(shard_id="s0", active_streams=1, cached_sessions=1, cache_bytes=0) if b"stat" in msg.data \
            else ControlReply(ok=True)
        await shard.publish(msg.reply, reply.model_dump_json().encode())

    await shard.subscribe(hop.control_subject, cb=answer)
    await flush_ordered(shard)
    transport = TransportSettings(step_timeout_s=2.0, control_timeout_s=2.0)
    chain = HopChain(orchestrator, "p-reconnect", [hop], node_id="orch", model_id="m", weights_sha256="0" * 64,
                     transport=transport, wire_dtype="fp32")
    try:
        assert await chain.open() is None
        sent = await chain.send_step(FrameKind.decode, 0, torch.zeros(1, 1, HIDDEN))
        reconnects = orchestrator.stats["reconnects"]
        await asyncio.to_thread(nats_server.restart)
        await _wait_until(lambda: orchestrator.stats["reconnects"] > reconnects and orchestrator.is_connected)
        output = await chain.await_step(sent)
        assert isinstance(output, StepFailure), output
        assert output.kind == "broker" and output.shard_id is None, output
    finally:
        await chain.close()
        for connection in (orchestrator, shard):
            with contextlib.suppress(Exception):
                await connection.close()

"""HopChain.send_step while the orchestrator's broker connection is away: a publish the client cannot buffer is a
`broker` failure (the call rebuilds once the broker is back), never an exception out of the call's loop."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from hearth.protocol.control import ControlReply
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

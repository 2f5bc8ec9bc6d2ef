"""HopChain tells the hops it opened that their orchestrator lives while it still waits for the others' answers: a
failover's re-open of a surviving hop waits for that shard's compute thread (a long step of another call), and the
replacement hop that answered at once must not be closed as an orphan meanwhile (hearth/services/shard/hops.py)."""

from __future__ import annotations

import asyncio

from hearth.protocol.control import ControlReply, ShardStat, StatShard
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.router import Hop
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

ORPHAN_TIMEOUT_S = 1.0
# The surviving hop's re-open answers after this: twice the replacement's orphan timeout.
SLOW_OPEN_S = 2 * ORPHAN_TIMEOUT_S
TRANSPORT = TransportSettings(control_timeout_s=4 * SLOW_OPEN_S, keepalive_interval_s=0.2)


async def test_a_hop_that_answered_open_at_once_is_kept_alive_while_another_hop_answers_late(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_TRANSPORT__ORPHAN_TIMEOUT_S", str(ORPHAN_TIMEOUT_S))
    async with tiny_shard_server(nats_server.url) as shard:
        slow = await connect_nats(nats_server.url, name="slow-shard")
        orchestrator = await connect_nats(nats_server.url, name="test-orchestrator")

        async def open_late(msg) -> None:  # a re-open behind another call's long step on that shard's compute thread
            await asyncio.sleep(SLOW_OPEN_S)
            await slow.publish(msg.reply, ControlReply(ok=True).model_dump_json().encode())

        await slow.subscribe("test.control.slow", cb=open_late)
        await flush_ordered(slow)
        hops = [Hop(shard_id="slow", control_subject="test.control.slow", node_id="n-slow", layer_lo_to_run=0,
                    layer_hi_to_run=1),
                Hop(shard_id="tiny-0-1", control_subject=shard.subject, node_id="node0", layer_lo_to_run=0,
                    layer_hi_to_run=1)]
        chain = HopChain(orchestrator, "p-slow-open", hops, node_id="orch", model_id="tiny", weights_sha256="0" * 64,
                         transport=TRANSPORT, max_session_tokens=CONTEXT)
        try:
            assert await chain.open() is None
            reply = await shard.client.request(shard.subject, StatShard().model_dump_json().encode(), timeout=5.0)
            assert "p-slow-open" in ShardStat.model_validate_json(reply.data).open_pipelines
        finally:
            await chain.close()
            await orchestrator.close()
            await slow.close()

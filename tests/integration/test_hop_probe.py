"""probe_outcome (the stall watch's liveness probe) against a real nats-server: answering, gone, silent."""

from __future__ import annotations

import asyncio

from hearth.protocol.control import ShardStat
from hearth.services.broker.connection import flush_ordered
from hearth.services.orchestrator.router import Hop
from hearth.services.transport.probe import ProbeOutcome, probe_outcome


def _hop(name: str) -> Hop:
    return Hop(shard_id=name, control_subject=f"test.control.{name}", node_id="n", layer_lo_to_run=0,
               layer_hi_to_run=0)


async def test_probe_tells_a_gone_shard_from_a_silent_one(connections):
    orchestrator, shard = connections
    answering, gone, silent = _hop("answering"), _hop("gone"), _hop("silent")

    async def answer(msg) -> None:
        stat = ShardStat(shard_id="answering", active_streams=0, cached_sessions=0, cache_bytes=0)
        await shard.publish(msg.reply, stat.model_dump_json().encode())

    async def ignore(msg) -> None:  # subscribed (connected) but never answers: frozen
        return None

    await shard.subscribe(answering.control_subject, cb=answer)
    await shard.subscribe(silent.control_subject, cb=ignore)
    await flush_ordered(shard)

    assert await probe_outcome(orchestrator, answering, 1.0) is ProbeOutcome.answered
    # Nobody subscribes to the gone shard's subject: the server says so at once, long before the timeout.
    assert await asyncio.wait_for(probe_outcome(orchestrator, gone, 30.0), 5.0) is ProbeOutcome.no_responder
    assert await probe_outcome(orchestrator, silent, 0.2) is ProbeOutcome.silent

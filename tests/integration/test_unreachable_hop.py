"""StallWatch's gone check against a real nats-server: a suspect hop that stays silent to two probes (a cut link:
the broker still holds its subscription) is failed over early; one that answers is left to the step timeout, and
so is a silent one when the step moved on while it was probed; the check repeats while the step stays held; our
own cut link blames no hop; and a chain's wait always reaches the watch."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass

from hearth.services.common.config import TransportSettings
import torch

from hearth.protocol.control import ControlReply, OpenHop, ShardStat, control_request_adapter
from hearth.protocol.subjects import LinkNodes
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.common.config_sections import loopback_host
from hearth.services.devtools.netbed_relay import LatencyRelay, Link
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.stall import StallWatch
from hearth.services.transport import AckWindowSender, FrameKind, StepInfo
from hearth.services.transport.mac import decode_link_key

TRANSPORT = TransportSettings(step_timeout_s=30.0, gone_check_after_s=0.05, gone_check_timeout_s=0.05,
                              probe_timeout_s=0.1)
STEP = StepInfo(session="s-watch", step=1, kind=FrameKind.decode, pos=0)
# A relay delay no probe outlives: the link is cut.
cut_rtt_ms = 600_000.0


def _hop(name: str) -> Hop:
    return Hop(shard_id=name, control_subject=f"test.control.{name}", node_id="n", layer_lo_to_run=0,
               layer_hi_to_run=0)


@dataclass
class Progress:
    hop: int
    last_ack_monotonic: float
    fully_acked: bool = True  # every chunk of the step reached `hop`


class Observer:
    """Hop 0 acked the step long ago; `ack_while_probed` makes hop 1 ack it during the first probe."""

    def __init__(self, ack_while_probed: bool = False) -> None:
        self.current = Progress(0, time.monotonic() - 1.0)
        self.ack_while_probed = ack_while_probed
        self.calls = 0

    def progress(self, session: str, step: int) -> Progress:
        self.calls += 1
        if self.ack_while_probed and self.calls > 2:
            return Progress(1, time.monotonic())
        return self.current


async def _mesh(orchestrator, shard, *, second_answers: bool) -> list[Hop]:
    hops = [_hop("first"), _hop("second")]

    async def answer(msg) -> None:
        stat = ShardStat(shard_id="x", active_streams=1, cached_sessions=1, cache_bytes=0)
        await shard.publish(msg.reply, stat.model_dump_json().encode())

    async def ignore(msg) -> None:  # subscribed, never answers: behind a cut link
        return None

    await shard.subscribe(hops[0].control_subject, cb=answer)
    await shard.subscribe(hops[1].control_subject, cb=answer if second_answers else ignore)
    await flush_ordered(shard)
    return hops


async def test_a_hop_silent_to_both_probes_is_failed_over_before_the_step_timeout(connections):
    orchestrator, shard = connections
    hops = await _mesh(orchestrator, shard, second_answers=False)
    watch = StallWatch(orchestrator, hops, Observer(), TRANSPORT)
    failure = await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s)
    assert failure is not None and failure.kind == "stalled" and failure.shard_id == "second"
    assert "does not answer probes" in failure.reason and "link cut" in failure.reason


async def test_hops_that_answer_are_left_to_the_step_timeout(connections):
    orchestrator, shard = connections
    hops = await _mesh(orchestrator, shard, second_answers=True)
    watch = StallWatch(orchestrator, hops, Observer(), TRANSPORT)
    assert await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s) is None
    watch.cancel()


async def test_a_silent_hop_is_not_blamed_when_the_step_moved_on_meanwhile(connections):
    orchestrator, shard = connections
    hops = await _mesh(orchestrator, shard, second_answers=False)
    watch = StallWatch(orchestrator, hops, Observer(ack_while_probed=True), TRANSPORT)
    assert await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s) is None
    watch.cancel()


async def test_a_step_the_sink_took_part_of_is_blamed_on_the_last_hop_once_it_is_due(connections):
    """The sink acked a chunk of the last hop's output, and the rest never came (the last hop died between chunks,
    or forged the sink's ack): before, the watch took the step as ours and waited out the call's whole deadline."""
    orchestrator, shard = connections
    hops = await _mesh(orchestrator, shard, second_answers=True)
    observer = Observer()
    observer.current = Progress(2, time.monotonic() - 1.0)  # hop index 2: the sink, after the two hops
    watch = StallWatch(orchestrator, hops, observer, TRANSPORT)
    assert await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s) is None  # not due yet
    failure = await watch.check(STEP, time.monotonic() - 1.0, 0.5)
    assert failure is not None and failure.kind == "stalled" and failure.shard_id == "second", failure
    assert "not passed on" in failure.reason


async def _watched_once_with_both_answering(orchestrator, shard) -> tuple[StallWatch, list[Hop]]:
    """A watch whose first gone check found both suspects answering, as during a long prefill on hop 0."""
    hops = [_hop("first"), _hop("second")]

    async def answer(msg) -> None:
        stat = ShardStat(shard_id="x", active_streams=1, cached_sessions=1, cache_bytes=0)
        await shard.publish(msg.reply, stat.model_dump_json().encode())

    subscriptions = [await shard.subscribe(hop.control_subject, cb=answer) for hop in hops]
    await flush_ordered(shard)
    watch = StallWatch(orchestrator, hops, Observer(), TRANSPORT)
    assert await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s) is None
    await subscriptions[1].unsubscribe()  # hop 1's host dies while hop 0 still computes the step
    return watch, hops


async def test_a_hop_that_dies_after_the_first_gone_check_is_failed_over_before_the_step_timeout(connections):
    """Before, the gone check ran once per step and holder: a host that died after it (hop 1 while hop 0 ran a long
    prefill) was found only once the whole step timeout (with its per-token share) had passed."""
    orchestrator, shard = connections
    watch, _ = await _watched_once_with_both_answering(orchestrator, shard)
    await flush_ordered(shard)
    await asyncio.sleep(TRANSPORT.gone_check_after_s * 2)
    failure = await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s)
    assert failure is not None and failure.kind == "gone" and failure.shard_id == "second", failure
    watch.cancel()


async def test_a_hop_answering_every_gone_check_is_left_to_the_step_timeout(connections):
    """The gone check repeats while a step is held, and hops that answer each time are never blamed early."""
    orchestrator, shard = connections
    hops = await _mesh(orchestrator, shard, second_answers=True)
    watch = StallWatch(orchestrator, hops, Observer(), TRANSPORT)
    for _ in range(3):
        assert await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s) is None
        await asyncio.sleep(TRANSPORT.gone_check_after_s * 2)
    watch.cancel()


async def test_our_own_link_cut_is_a_broker_failure_not_a_silent_hop(nats_server):
    """Our household's link is cut: the connection looks up until its pings go unanswered (10-15 s), and every hop
    is silent to our probes. Before, the watch blamed a healthy hop (kept out of every call's routing for a while,
    and the failover's opens then timed out on every shard); now a ping of our own connection that goes unanswered
    says the broker link is what failed."""
    port = free_tcp_port()
    relay = LatencyRelay(loopback_host, [Link(listen_port=port, upstream_port=nats_server.port)])
    await relay.start()
    orchestrator = await connect_nats(f"nats://{loopback_host}:{port}", name="test-orchestrator")
    shard = await connect_nats(nats_server.url, name="test-shard")
    try:
        hops = await _mesh(orchestrator, shard, second_answers=True)
        watch = StallWatch(orchestrator, hops, Observer(), TRANSPORT)
        relay.set_rtt(port, cut_rtt_ms)  # nothing crosses the link from now on
        failure = await watch.check(STEP, time.monotonic() - 1.0, TRANSPORT.step_timeout_s)
        assert failure is not None and failure.kind == "broker" and failure.shard_id is None, failure
        watch.cancel()
    finally:
        for connection in (orchestrator, shard):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 2.0)
        await relay.close()


async def test_a_last_hop_flooding_the_sink_with_other_steps_is_still_failed_over(connections):
    """The last hop (with the link key of the sink, so its frames are taken) sends step after step of the session
    that nobody awaits, more often than the chain polls: before, every such output sent the wait round again without
    a look at the stall watch, and the call waited forever; now the step still fails within its timeout."""
    orchestrator, shard = connections
    hop = _hop("flooding")
    opened: list[OpenHop] = []

    async def answer(msg) -> None:
        request = control_request_adapter.validate_json(msg.data)
        if isinstance(request, OpenHop):
            opened.append(request)
            reply = ControlReply(ok=True)
        else:
            reply = ShardStat(shard_id="flooding", active_streams=1, cached_sessions=1, cache_bytes=0)
        await shard.publish(msg.reply, reply.model_dump_json().encode())

    await shard.subscribe(hop.control_subject, cb=answer)
    await flush_ordered(shard)
    transport = TransportSettings(step_timeout_s=1.0, gone_check_after_s=0.2, control_timeout_s=2.0)
    chain = HopChain(orchestrator, "p-flood", [hop], node_id="orch", model_id="m", weights_sha256="0" * 64,
                     transport=transport, wire_dtype="fp32")
    assert await chain.open() is None
    request = opened[0]
    flood = AckWindowSender(shard, "p-flood", 1, nodes=LinkNodes(sender="n", receiver="orch"),
                            link_key=decode_link_key(request.outbound_link_key), seal=request.seal_activations,
                            window_chunks=1 << 16)
    await flood.start()

    async def keep_flooding() -> None:
        for step in itertools.count(1000):
            await flood.send(StepInfo(session=request.session_id, step=step, kind=FrameKind.decode, pos=0),
                             torch.zeros(1, 1, 8))
            await asyncio.sleep(0.01)

    flooding = asyncio.create_task(keep_flooding())
    try:
        stepping = chain.step(FrameKind.decode, 0, torch.zeros(1, 1, 8))
        output = await asyncio.wait_for(stepping, 10 * transport.step_timeout_s)
        assert isinstance(output, StepFailure) and output.shard_id == "flooding", output
    finally:
        flooding.cancel()
        await asyncio.gather(flooding, return_exceptions=True)
        await flood.close()
        await chain.close()


async def test_a_hop_0_that_dies_while_a_step_waits_for_window_space_is_found_by_the_gone_check(connections):
    """A step of more chunks than the window (a prefill chunk of a wide model, or a whole prompt with chunked prefill
    off) into a hop 0 that died after `open`: before, send_step waited for window space without a look at the stall
    watch, and the dead hop was failed over only after step_timeout_s as `stalled`; now the gone check finds it."""
    orchestrator, shard = connections
    hop = _hop("dies")

    async def answer(msg) -> None:
        await shard.publish(msg.reply, ControlReply(ok=True).model_dump_json().encode())

    control = await shard.subscribe(hop.control_subject, cb=answer)
    await flush_ordered(shard)
    transport = TransportSettings(step_timeout_s=3.0, gone_check_after_s=0.1, gone_check_timeout_s=0.2,
                                  probe_timeout_s=0.2, window_chunks=2, chunk_bytes=1024)
    chain = HopChain(orchestrator, "p-dies", [hop], node_id="orch", model_id="m", weights_sha256="0" * 64,
                     transport=transport, wire_dtype="fp32")
    try:
        assert await chain.open() is None
        await control.unsubscribe()  # its host dies: no responder, and nobody takes (or acks) its frames
        await flush_ordered(shard)
        sent = await asyncio.wait_for(chain.send_step(FrameKind.prefill, 0, torch.zeros(1, 4, 256)),  # 4 chunks
                                      10 * transport.step_timeout_s)
        assert isinstance(sent, StepFailure) and sent.kind == "gone" and sent.shard_id == "dies", sent
    finally:
        await chain.close()

"""StallWatch's gone check against a real nats-server: a suspect hop that stays silent to two probes (a cut link:
the broker still holds its subscription) is failed over early; one that answers is left to the step timeout, and
so is a silent one when the step moved on while it was probed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hearth.services.common.config import TransportSettings
from hearth.protocol.control import ShardStat
from hearth.services.broker.connection import flush_ordered
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.stall import StallWatch
from hearth.services.transport import FrameKind, StepInfo

TRANSPORT = TransportSettings(step_timeout_s=30.0, gone_check_after_s=0.05, gone_check_timeout_s=0.05,
                              probe_timeout_s=0.1)
STEP = StepInfo(session="s-watch", step=1, kind=FrameKind.decode, pos=0)


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

"""Whom the orchestrator's stall watch blames for a step that does not come out: the hop holding it, told by acks. The
hop before a hop holds the key of the link into it and may send it anything, so a hop's acks must mean that it took the
step in, and holding a step must mean having all of it:

- a hop acks only what it takes in: were the chunks of a step at or below the newest one handed out (stale: never run)
  acked, the hop before could send a later step of the session first, then the real one, and have the honest hop
  that acked and dropped it blamed for the stall;
- a hop that acked some of a step's chunks but not all waits for the rest from the hop before, which holds the step:
  else the hop before could send a chunk of it, then a later step whole (the partial one is abandoned, and its other
  chunks are stale), and again have the honest hop blamed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from hearth.protocol.control import ShardStat
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.stall import StallWatch
from hearth.services.transport import AckHeader, ActivationReceiver, AckObserver, FrameKind, StepInfo, encode_step
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.mac import ack_witness_key, new_link_key

PIPELINE = "pipe-stale"


class _Acks:
    max_payload = 2**20

    def __init__(self) -> None:
        self.acks: list[AckHeader] = []

    async def publish(self, subject: str, payload: bytes, headers=None) -> None:
        self.acks.append(AckHeader.from_nats_headers(headers))


def _frame(step: int, pos: int, hop: int = 1) -> SimpleNamespace:
    encoded = encode_step(StepInfo(session="s", step=step, kind=FrameKind.decode, pos=pos), torch.ones(1, 1, 8))
    return SimpleNamespace(headers=encoded.header(PIPELINE, hop, 0).to_nats_headers(), data=bytes(encoded.chunks[0]))


async def test_a_step_sent_after_a_later_one_is_not_acked_and_so_not_held_by_this_hop():
    connection = _Acks()
    receiver = ActivationReceiver(connection, PIPELINE, 1)
    observer = AckObserver(None, PIPELINE, sink_hop=3)  # type: ignore[arg-type]
    observer.record(AckHeader(pipeline_id=PIPELINE, hop=0, session="s", step=7, chunk_index=0, chunk_count=1))

    await receiver._on_frame(_frame(8, 5))  # forged by the hop before: the session's next step, ahead of its turn
    await receiver._on_frame(_frame(7, 4))  # the step the orchestrator sent, passed on after it
    for ack in connection.acks:
        observer.record(ack)

    assert [step.step for step in receiver.take_ready()] == [8]
    assert receiver.stats.stale_chunks == 1
    assert [ack.step for ack in connection.acks] == [8]
    assert observer.holder("s", 7) == 0  # the hop before holds it: the stall watch blames the one that lied


class _EveryHopAnswers:
    """A connection on which every shard answers its `stat` probe (all are alive: blame goes to the holder)."""

    async def request(self, subject: str, payload: bytes, timeout: float) -> SimpleNamespace:
        return SimpleNamespace(data=ShardStat(shard_id="x", active_streams=1, cached_sessions=1,
                                              cache_bytes=0).model_dump_json().encode())


def _ack(hop: int, chunk: int, count: int, at: float) -> tuple[AckHeader, float]:
    return AckHeader(pipeline_id=PIPELINE, hop=hop, session="s", step=7, chunk_index=chunk, chunk_count=count), at


async def test_a_step_partly_acked_by_a_hop_is_held_by_the_hop_before_it():
    hops = [Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.n{index}.shard-{index}", node_id=f"n{index}",
                layer_lo_to_run=index, layer_hi_to_run=index) for index in range(3)]
    long_ago = time.monotonic() - 100.0

    async def blamed(acks: list[tuple[AckHeader, float]]) -> str | None:
        observer = AckObserver(None, PIPELINE, sink_hop=3)  # type: ignore[arg-type]
        for ack, at in acks:
            observer.record(ack, now_monotonic=at)
        watch = StallWatch(_EveryHopAnswers(), hops, observer, TransportSettings())  # type: ignore[arg-type]
        failure = await watch.check(StepInfo(session="s", step=7, kind=FrameKind.decode, pos=4), long_ago, 1.0)
        return None if failure is None else failure.shard_id

    # Hop 0 took the whole step in; hop 1 one chunk of the two hop 0 announced: hop 0 owes the other.
    assert await blamed([_ack(0, 0, 1, long_ago), _ack(1, 0, 2, long_ago)]) == "shard-0"
    # Hop 1 took it all in and did not pass it on: hop 1 holds it.
    assert await blamed([_ack(0, 0, 1, long_ago), _ack(1, 0, 2, long_ago), _ack(1, 1, 2, long_ago)]) == "shard-1"
    # Hop 0 took in part of what the orchestrator sent: hop 0 is the one to look at, as before any ack.
    assert await blamed([_ack(0, 0, 2, long_ago)]) == "shard-0"


def _signed_ack(hop: int, step: int, link_keys: dict, notice_keys: dict, chunk: int = 0,
                count: int = 1) -> SimpleNamespace:
    headers = AckHeader(pipeline_id=PIPELINE, hop=hop, session="s", step=step, chunk_index=chunk,
                        chunk_count=count).to_nats_headers()
    LinkAuth(link_keys[hop], sealed=False, ack_witness_key=ack_witness_key(notice_keys[hop])).sign_ack(headers)
    return SimpleNamespace(headers=headers, data=b"", subject=f"hearth.ack.x.{PIPELINE}.{hop}")


async def test_a_hops_own_acks_of_steps_not_out_neither_push_out_the_awaited_step_nor_grow_without_bound():
    """Hop 1's acks carry its own MAC and witness, whatever they name: acks of 256 steps that were never sent pushed
    the step awaited out of the table, and with no ack on record the stall watch blamed hop 0 for it; acks of one
    step's chunks under a count of a billion grew its table by one entry each."""
    link_keys = {hop: new_link_key() for hop in range(3)}
    notice_keys = {hop: new_link_key() for hop in range(3)}
    outstanding = {7}
    observer = AckObserver(None, PIPELINE, sink_hop=2, link_keys=link_keys,  # type: ignore[arg-type]
                           ack_witness_keys={hop: ack_witness_key(key) for hop, key in notice_keys.items()},
                           tracked=lambda session, step: session == "s" and step in outstanding, max_chunks_per_step=64)
    await observer._on_ack(_signed_ack(0, 7, link_keys, notice_keys))
    await observer._on_ack(_signed_ack(1, 7, link_keys, notice_keys))
    for bogus in range(1000, 1300):
        await observer._on_ack(_signed_ack(1, bogus, link_keys, notice_keys))
    for chunk in range(1000):
        await observer._on_ack(_signed_ack(1, 7, link_keys, notice_keys, chunk=chunk, count=999_999_999))
    assert observer.holder("s", 7) == 1
    assert observer.progress("s", 1000) is None
    assert observer.progress("s", 7).chunks_acked <= 64

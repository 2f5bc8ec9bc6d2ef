"""The ack window against a real nats-server: a silent hop blocks the sender after window_chunks, then times out."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.protocol.subjects import ack_subject, activation_subject
from hearth.services.broker.connection import flush_ordered
from hearth.services.transport import (
    AckHeader,
    AckWindowSender,
    ActivationReceiver,
    FrameHeader,
    FrameKind,
    StepInfo,
    TransportTimeout,
)

pytestmark = pytest.mark.integration

PIPELINE = "pipe-bp"
wait_s = 5.0



async def until(condition, timeout_s: float = wait_s) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_sender_blocks_after_exactly_window_chunks_then_raises_transport_timeout(connections):
    source, hop = connections
    arrived: list[FrameHeader] = []

    async def silent_hop(msg):  # takes frames, never acks
        arrived.append(FrameHeader.from_nats_headers(msg.headers))

    sub = await hop.subscribe(activation_subject(PIPELINE, 1), cb=silent_hop)
    await flush_ordered(hop)
    async with AckWindowSender(source, PIPELINE, 1, window_chunks=4, ack_timeout_s=0.4, chunk_bytes=1024) as sender:
        step = StepInfo(session="s1", step=7, kind=FrameKind.prefill)
        with pytest.raises(TransportTimeout) as raised:
            await sender.send(step, torch.randn(10, 256))  # 10 KiB: 10 chunks
        await flush_ordered(source)
        await flush_ordered(hop)

        assert len(arrived) == 4 and [frame.chunk_index for frame in arrived] == [0, 1, 2, 3]
        assert all(frame.chunk_count == 10 for frame in arrived)
        assert sender.in_flight_chunks == 4 and sender.stats.chunks_sent == 4
        error = raised.value
        assert (error.pipeline_id, error.hop, error.session, error.step) == (PIPELINE, 1, "s1", 7)
        assert error.in_flight_chunks == 4
        assert "hop 1" in str(error) and "step 7" in str(error)
    await sub.unsubscribe()


async def test_acks_reopen_the_window_and_the_blocked_send_completes(connections):
    source, hop = connections
    held: list[FrameHeader] = []

    async def hold(msg):
        held.append(FrameHeader.from_nats_headers(msg.headers))

    sub = await hop.subscribe(activation_subject(PIPELINE, 0), cb=hold)
    await flush_ordered(hop)
    async with AckWindowSender(source, PIPELINE, 0, window_chunks=2, ack_timeout_s=wait_s, chunk_bytes=100) as sender:
        sending = asyncio.ensure_future(
            sender.send(StepInfo(session="s1", step=0, kind=FrameKind.prefill), torch.randn(100))  # 4 chunks
        )
        await until(lambda: len(held) == 2)
        await asyncio.sleep(0.1)
        assert not sending.done() and len(held) == 2  # blocked on the full window

        for frame in list(held):  # the hop catches up and acks what it has
            ack = AckHeader.for_frame(frame)
            await hop.publish(ack_subject(PIPELINE, 0), b"", headers=ack.to_nats_headers())
        sent = await asyncio.wait_for(sending, wait_s)
        await until(lambda: len(held) == 4)
        assert sent.chunk_count == 4 and [frame.chunk_index for frame in held] == [0, 1, 2, 3]
        assert sent.window_wait_s > 0 and sender.stats.window_waits >= 1
    await sub.unsubscribe()


async def test_a_consumer_that_stops_taking_steps_stops_the_acks_and_the_sender(connections):
    source, hop = connections
    decode = [StepInfo(session="s1", step=step, kind=FrameKind.decode, pos=step) for step in range(5)]
    async with ActivationReceiver(hop, PIPELINE, 0, max_ready_steps=1) as receiver, AckWindowSender(
        source, PIPELINE, 0, window_chunks=2, ack_timeout_s=0.4
    ) as sender:
        for info in decode[:3]:
            await sender.send(info, torch.full((1, 1, 8), float(info.step)))
        # step 0 waits in the ready queue, step 1 waits for room (un-acked), step 2 waits behind it.
        await until(lambda: sender.in_flight_chunks == 2 and receiver.ready_steps == 1)
        with pytest.raises(TransportTimeout):
            await sender.send(decode[3], torch.zeros(1, 1, 8))

        taken = [await receiver.next_step(wait_s) for _ in range(3)]
        await sender.wait_all_acked(wait_s)
        await sender.send(decode[4], torch.full((1, 1, 8), 4.0))
        taken.append(await receiver.next_step(wait_s))

    assert [received.step for received in taken] == [0, 1, 2, 4]
    assert [received.tensor.flatten()[0].item() for received in taken] == [0.0, 1.0, 2.0, 4.0]


async def test_interrupting_a_wait_for_the_next_step_ends_it_at_once_and_only_once(connections):
    from hearth.services.transport import WaitInterrupted

    source, hop = connections
    receiver = ActivationReceiver(hop, PIPELINE, 0)
    sender = AckWindowSender(source, PIPELINE, 0, window_chunks=4, ack_timeout_s=wait_s)
    await receiver.start()
    await sender.start()
    try:
        waiting = asyncio.create_task(receiver.next_step(timeout_s=wait_s))
        await until(lambda: receiver._getters)
        receiver.interrupt_waiters()
        with pytest.raises(WaitInterrupted):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(TransportTimeout):
            await receiver.next_step(timeout_s=0.05)  # the interruption was used up
        receiver.interrupt_waiters()  # nobody waiting: the next wait without a ready step ends at once
        with pytest.raises(WaitInterrupted):
            await receiver.next_step(timeout_s=wait_s)
        await sender.send(StepInfo(session="s1", step=1, kind=FrameKind.decode), torch.ones(1, 1, 8))
        received = await receiver.next_step(timeout_s=wait_s)
        assert received.step == 1 and torch.equal(received.tensor, torch.ones(1, 1, 8))
    finally:
        await sender.close()
        await receiver.close()

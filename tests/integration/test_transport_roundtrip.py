"""Activation frames across a real nats-server: big steps in several chunks, dtypes, duplicates, stale steps, close."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.protocol.subjects import ack_subject
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.transport import (
    AckHeader,
    AckWindowSender,
    ActivationReceiver,
    FrameKind,
    StepInfo,
    TransportClosed,
    TransportTimeout,
    WireDtype,
    encode_step,
)

pytestmark = pytest.mark.integration

PIPELINE = "pipe-rt"
wait_s = 5.0



async def test_prefill_activation_crosses_in_several_chunks_bitwise(connections):
    source, hop = connections
    activation = torch.randn(1, 600, 1024, dtype=torch.float32)  # 2.4 MiB
    async with ActivationReceiver(hop, PIPELINE, 0) as receiver, AckWindowSender(source, PIPELINE, 0) as sender:
        sent = await sender.send(StepInfo(session="s1", step=0, kind=FrameKind.prefill, pos=0), activation)
        received = await receiver.next_step(wait_s)
        await sender.wait_all_acked(wait_s)

    assert sent.chunk_count == 3 and sent.total_bytes == 600 * 1024 * 4
    assert received.header.chunk_count == 3
    assert received.info == StepInfo(session="s1", step=0, kind=FrameKind.prefill, pos=0)
    assert received.tensor.dtype == torch.float32
    assert torch.equal(received.tensor.view(torch.int32), activation.view(torch.int32))
    assert receiver.stats.chunks_received == 3 and receiver.stats.steps_received == 1
    assert sender.stats.chunks_sent == 3 and sender.in_flight_chunks == 0
    assert received.wire_s is not None and received.wire_s >= 0 and received.decode_s > 0


async def test_chunks_shrink_to_fit_a_small_server_max_payload(tmp_path):
    with EmbeddedNatsServer(store_dir=tmp_path / "small", max_payload_bytes=64 * 1024) as server:
        source = await connect_nats(server.url, name="small-source")
        hop = await connect_nats(server.url, name="small-hop")
        try:
            activation = torch.randn(100, 1024).to(torch.bfloat16)  # 200 KiB
            async with ActivationReceiver(hop, PIPELINE, 0) as receiver, AckWindowSender(source, PIPELINE, 0) as sender:
                assert sender.chunk_bytes <= 64 * 1024 - 1024
                sent = await sender.send(StepInfo(session="s1", step=0, kind=FrameKind.prefill), activation)
                received = await receiver.next_step(wait_s)
        finally:
            await source.close()
            await hop.close()
    assert sent.chunk_count == 4
    assert received.tensor.dtype == torch.bfloat16 and torch.equal(received.tensor, activation)


async def test_int8_and_fp16_wire_restore_the_compute_dtype(connections):
    source, hop = connections
    activation = torch.randn(1, 7, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    async with ActivationReceiver(hop, PIPELINE, 0) as receiver, AckWindowSender(
        source, PIPELINE, 0, wire_dtype=WireDtype.int8
    ) as sender:
        await sender.send(StepInfo(session="s1", step=0, kind=FrameKind.prefill), activation)
        await sender.send(StepInfo(session="s1", step=1, kind=FrameKind.decode, pos=7), activation[:, -1:],
                          wire_dtype=WireDtype.float16)
        as_int8 = await receiver.next_step(wait_s)
        as_fp16 = await receiver.next_step(wait_s)
    assert as_int8.wire_dtype is WireDtype.int8 and as_int8.tensor.dtype == torch.bfloat16
    assert (as_int8.tensor.float() - activation.float()).abs().max() <= activation.float().abs().max() / 127
    assert as_fp16.wire_dtype is WireDtype.float16 and as_fp16.tensor.dtype == torch.bfloat16
    assert torch.equal(as_fp16.tensor, activation[:, -1:])  # bf16 -> fp16 -> bf16 is exact for N(0,1) values


async def test_duplicates_and_stale_steps_are_handed_out_once_and_stale_ones_not_acked(connections):
    source, hop = connections
    acks: list[AckHeader] = []

    async def collect(msg):
        acks.append(AckHeader.from_nats_headers(msg.headers))

    ack_sub = await source.subscribe(ack_subject(PIPELINE, 0), cb=collect)
    async with ActivationReceiver(hop, PIPELINE, 0) as receiver:
        subject = receiver.subject

        async def publish(step: int, value: float) -> None:
            encoded = encode_step(StepInfo(session="s1", step=step, kind=FrameKind.decode, pos=step),
                                  torch.full((1, 1, 4), value))
            await source.publish(subject, encoded.chunks[0], headers=encoded.header(PIPELINE, 0, 0).to_nats_headers())

        await publish(5, 5.0)
        await publish(5, 55.0)  # duplicate of a delivered step: stale
        await publish(4, 4.0)  # older than the newest delivered step: stale
        await source.publish(subject, b"junk", headers={"Hearth-Session": "s1"})  # bad frame: dropped, not acked
        await publish(6, 6.0)
        first = await receiver.next_step(wait_s)
        second = await receiver.next_step(wait_s)
        with pytest.raises(TransportTimeout, match="no complete step"):
            await receiver.next_step(0.2)
        await flush_ordered(source)
        await flush_ordered(hop)

    await ack_sub.unsubscribe()
    assert (first.step, first.tensor.flatten()[0].item()) == (5, 5.0)
    assert (second.step, second.tensor.flatten()[0].item()) == (6, 6.0)
    assert receiver.stats.stale_chunks == 2 and receiver.stats.bad_frames == 1
    assert sorted(ack.step for ack in acks) == [5, 6]  # a stale step is not taken in: not acked
    assert all(ack.hop == 0 and ack.session == "s1" and ack.chunk_count == 1 for ack in acks)


async def test_reset_step_passes_without_a_tensor(connections):
    source, hop = connections
    async with ActivationReceiver(hop, PIPELINE, 0) as receiver, AckWindowSender(source, PIPELINE, 0) as sender:
        await sender.send_reset("s1", 3)
        received = await receiver.next_step(wait_s)
    assert received.kind is FrameKind.reset and received.step == 3 and received.tensor is None


async def test_close_ends_iteration_wakes_waiters_and_stops_acking(connections):
    source, hop = connections
    receiver = await ActivationReceiver(hop, PIPELINE, 0).start()
    sender = await AckWindowSender(source, PIPELINE, 0, window_chunks=1, ack_timeout_s=0.3).start()
    waiting = asyncio.ensure_future(receiver.next_step(wait_s))
    iterated: list[int] = []

    async def iterate():
        async for received in receiver:
            iterated.append(received.step)

    iteration = asyncio.ensure_future(iterate())
    await asyncio.sleep(0.05)
    await receiver.close()

    with pytest.raises(TransportClosed):
        await asyncio.wait_for(waiting, wait_s)
    await asyncio.wait_for(iteration, wait_s)  # async for ends quietly
    assert iterated == []
    await sender.send(StepInfo(session="s1", step=0, kind=FrameKind.decode), torch.zeros(1, 1, 4))
    with pytest.raises(TransportTimeout):  # nobody subscribes any more, so nothing acks
        await sender.wait_all_acked()
    await sender.close()
    with pytest.raises(TransportClosed):
        await sender.send(StepInfo(session="s1", step=1, kind=FrameKind.decode), torch.zeros(1, 1, 4))

"""The ack window against a real nats-server when acks get lost (a link that dropped between a frame and its ack):
a later ack of the same session settles the earlier chunks, so lost acks never fill the window."""

from __future__ import annotations

import pytest
import torch

from hearth.protocol.subjects import ack_subject, activation_subject
from hearth.services.broker.connection import flush_ordered
from hearth.services.transport import AckHeader, AckWindowSender, FrameHeader, FrameKind, StepInfo, TransportTimeout

pytestmark = pytest.mark.integration

PIPELINE = "pipe-lost-acks"
wait_s = 5.0


async def _acking_hop(hop, loses):
    """Subscribe a hop that acks every frame but those `loses(header)` says were lost on the way back."""
    arrived: list[FrameHeader] = []

    async def on_frame(msg):
        header = FrameHeader.from_nats_headers(msg.headers)
        arrived.append(header)
        if not loses(header):
            await hop.publish(ack_subject(PIPELINE, 0), b"", headers=AckHeader.for_frame(header).to_nats_headers())

    sub = await hop.subscribe(activation_subject(PIPELINE, 0), cb=on_frame)
    await flush_ordered(hop)
    return sub, arrived


async def test_lost_acks_are_settled_by_a_later_ack_of_the_session_and_never_stall_the_hop(connections):
    source, hop = connections
    # The last chunk's ack of every step is lost: before, each step leaked one slot and the fifth stalled.
    sub, arrived = await _acking_hop(hop, lambda header: header.chunk_index == header.chunk_count - 1)
    async with AckWindowSender(source, PIPELINE, 0, window_chunks=4, ack_timeout_s=1.0, chunk_bytes=1024) as sender:
        for step in range(12):
            await sender.send(StepInfo(session="s1", step=step, kind=FrameKind.prefill), torch.randn(2, 256))  # 2 KiB
        await flush_ordered(source)
        await flush_ordered(hop)
        await flush_ordered(source)
        assert len(arrived) == 24
        assert sender.in_flight_chunks == 1  # only the newest step's lost ack: nothing came after it yet
        assert sender.stats.acks_lost == 11
        assert sender.stats.timeouts == 0
    await sub.unsubscribe()


async def test_an_ack_of_another_session_settles_nothing_and_a_silent_session_still_blocks(connections):
    source, hop = connections
    sub, _ = await _acking_hop(hop, lambda header: header.session == "silent")
    async with AckWindowSender(source, PIPELINE, 0, window_chunks=4, ack_timeout_s=0.3, chunk_bytes=1024) as sender:
        await sender.send(StepInfo(session="silent", step=0, kind=FrameKind.prefill), torch.randn(3, 256))  # 3 chunks
        await sender.send(StepInfo(session="acked", step=0, kind=FrameKind.decode), torch.randn(1, 256))
        await flush_ordered(source)
        await flush_ordered(hop)
        await flush_ordered(source)
        assert sender.in_flight_chunks == 3 and sender.stats.acks_lost == 0
        # The receiver really stopped acking that session: backpressure holds.
        with pytest.raises(TransportTimeout):
            await sender.send(StepInfo(session="silent", step=1, kind=FrameKind.prefill), torch.randn(2, 256))
    await sub.unsubscribe()


async def test_a_window_full_of_acks_lost_in_our_reconnect_is_settled_and_the_step_goes_on(nats_server):
    """The sender's connection drops in the middle of a step of more chunks than the window: the hop took every frame
    and acked each while our ack subscription was gone, so no later ack of the session can come (the window is full
    and nothing more is sent). Before, the step waited out the ack timeout and the healthy hop after was blamed; now
    the chunks published before our reconnect are settled once it happened."""
    import asyncio

    from hearth.services.broker.connection import connect_nats

    source = await connect_nats(nats_server.url, name="test-source")
    hop = await connect_nats(nats_server.url, name="test-hop")
    acks_lost = asyncio.Event()  # the first window's acks never reach us: they went out while we were away
    try:
        sub, arrived = await _acking_hop(hop, lambda header: not acks_lost.is_set())
        sending_side = AckWindowSender(source, PIPELINE, 0, window_chunks=4, ack_timeout_s=10.0, chunk_bytes=1024)
        async with sending_side as sender:
            sending = asyncio.ensure_future(
                sender.send(StepInfo(session="s1", step=0, kind=FrameKind.prefill), torch.randn(8, 256)))  # 8 chunks
            deadline = asyncio.get_running_loop().time() + wait_s
            while len(arrived) < 4 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert len(arrived) == 4 and not sending.done() and sender.in_flight_chunks == 4
            acks_lost.set()
            reconnects = source.stats["reconnects"]
            await asyncio.to_thread(nats_server.restart)
            sent = await asyncio.wait_for(sending, wait_s)
            assert source.stats["reconnects"] > reconnects
            assert sent.chunk_count == 8 and sender.stats.acks_lost >= 4 and sender.stats.timeouts == 0
        await sub.unsubscribe()
    finally:
        await source.close()
        await hop.close()

"""Authenticated activations across a real nats-server: with a link key, frames and acks carry a MAC; a frame
injected on the link (well formed, but without the key) is dropped and counted, the real step still arrives
bitwise, and a forged ack frees nothing in the sender's window."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.protocol.subjects import ack_subject, activation_subject
from hearth.services.broker.connection import flush_ordered
from hearth.services.transport import AckHeader, AckWindowSender, ActivationReceiver, FrameKind, StepInfo, encode_step
from hearth.services.transport.mac import HEADER_MAC, link_mac_key, new_link_key, with_mac

pytestmark = pytest.mark.integration
PIPELINE = "pipe-mac"
wait_s = 5.0


async def test_injected_frames_are_dropped_and_the_real_step_arrives(connections):
    source, hop = connections
    key = new_link_key()
    real = torch.randn(1, 4, 64)
    forged = torch.zeros(1, 4, 64)
    info = StepInfo(session="s1", step=1, kind=FrameKind.prefill, pos=0)
    async with ActivationReceiver(hop, PIPELINE, 0, link_key=key) as receiver, \
            AckWindowSender(source, PIPELINE, 0, link_key=key) as sender:
        encoded = encode_step(info, forged)
        headers = encoded.header(PIPELINE, 0, 0).to_nats_headers()
        # The same step, first without a MAC, then with one made with another key: both dropped unread.
        await source.publish(activation_subject(PIPELINE, 0), encoded.chunks[0], headers=dict(headers))
        await source.publish(activation_subject(PIPELINE, 0), encoded.chunks[0],
                             headers=with_mac(new_link_key(), dict(headers), encoded.chunks[0]))
        await flush_ordered(source)
        await sender.send(info, real)
        received = await receiver.next_step(wait_s)
        await sender.wait_all_acked(wait_s)
    assert torch.equal(received.tensor, real)
    assert receiver.stats.unauthenticated_frames == 2
    assert receiver.stats.steps_received == 1


async def test_a_forged_ack_frees_nothing(connections):
    source, hop = connections
    key = new_link_key()
    got_frame = asyncio.Event()
    macs: list[str] = []

    async def silent_hop(msg):  # takes the frame, never acks it
        macs.append(msg.headers.get(HEADER_MAC, ""))
        got_frame.set()

    subscription = await hop.subscribe(activation_subject(PIPELINE, 0), cb=silent_hop)
    await flush_ordered(hop)
    try:
        async with AckWindowSender(source, PIPELINE, 0, link_key=key, window_chunks=1) as sender:
            info = StepInfo(session="s1", step=1, kind=FrameKind.decode, pos=0)
            await sender.send(info, torch.randn(1, 1, 64))
            await asyncio.wait_for(got_frame.wait(), wait_s)
            header = encode_step(info, torch.randn(1, 1, 64)).header(PIPELINE, 0, 0)
            ack_headers = AckHeader.for_frame(header, acked_ns=0).to_nats_headers()
            await hop.publish(ack_subject(PIPELINE, 0), b"", headers=ack_headers)  # no MAC
            await hop.publish(ack_subject(PIPELINE, 0), b"", headers=with_mac(new_link_key(), dict(ack_headers), b""))
            await flush_ordered(hop)
            await asyncio.sleep(0.2)  # nothing to await: the point is that nothing happens
            assert sender.in_flight_chunks == 1
            assert sender.stats.bad_acks == 2
            # The genuine ack, with the link's MAC (its key derived from the link key), frees the window.
            await hop.publish(ack_subject(PIPELINE, 0), b"",
                              headers=with_mac(link_mac_key(key), dict(ack_headers), b""))
            await sender.wait_all_acked(wait_s)
    finally:
        await subscription.unsubscribe()
    assert len(macs[0]) == 32  # 16-byte BLAKE2b, hex

"""Sealed activations across a real nats-server: a third client that reads every activation subject, as the broker's
host could, captures a sealed link's frames and finds neither the tensor's bytes nor anything that decodes as it,
while the hop gets the step bitwise; an unsealed frame on a sealed link and a captured frame replayed into another
step or link are dropped and counted; MAC-only links (the other mode) still carry steps in clear."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.protocol.subjects import activation_subject
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.transport import (
    AckWindowSender,
    ActivationReceiver,
    FrameError,
    FrameHeader,
    FrameKind,
    StepInfo,
    decode_frames,
    encode_step,
)
from hearth.services.transport.headers import HEADER_STEP
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.mac import new_link_key
from hearth.services.transport.seal import HEADER_SEAL

pytestmark = pytest.mark.integration
PIPELINE = "pipe-seal"
wait_s = 5.0
# A 64-token prefill step of a 2048-wide model: several chunks at this chunk size.
PREFILL_SHAPE = (1, 64, 2048)
CHUNK_BYTES = 128 * 1024


class BrokerEye:
    """A third client subscribed to every activation subject with a wildcard: what the broker's host can read."""

    def __init__(self) -> None:
        self.frames: list[tuple[dict[str, str], bytes]] = []
        self.arrived = asyncio.Event()

    async def on_frame(self, msg) -> None:
        self.frames.append((dict(msg.headers or {}), msg.data))
        self.arrived.set()


@pytest.fixture
async def eye(nats_url):
    client = await connect_nats(nats_url, name="test-broker-eye")
    watcher = BrokerEye()
    await client.subscribe("hearth.act.>", cb=watcher.on_frame)
    await flush_ordered(client)
    yield watcher
    await client.close()


async def eventually(condition, what: str) -> None:
    """Wait (at most wait_s) for a callback on another connection to have run."""
    async with asyncio.timeout(wait_s):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_the_broker_sees_only_ciphertext_and_the_hop_gets_the_step_bitwise(connections, eye, dtype):
    source, hop = connections
    key = new_link_key()
    prefill = torch.randn(PREFILL_SHAPE).to(dtype)
    decode = torch.randn(1, 1, PREFILL_SHAPE[-1]).to(dtype)
    async with ActivationReceiver(hop, PIPELINE, 0, link_key=key, seal=True) as receiver, \
            AckWindowSender(source, PIPELINE, 0, link_key=key, seal=True, chunk_bytes=CHUNK_BYTES) as sender:
        await sender.send(StepInfo(session="s1", step=0, kind=FrameKind.prefill, pos=0), prefill)
        await sender.send(StepInfo(session="s1", step=1, kind=FrameKind.decode, pos=64), decode)
        received = [await receiver.next_step(wait_s), await receiver.next_step(wait_s)]
        await sender.wait_all_acked(wait_s)
    assert torch.equal(received[0].tensor.view(torch.uint8), prefill.view(torch.uint8))
    assert torch.equal(received[1].tensor.view(torch.uint8), decode.view(torch.uint8))

    expected = received[0].header.chunk_count + 1
    await eventually(lambda: len(eye.frames) >= expected, "the broker's eye saw every frame")
    captured = eye.frames
    assert len(captured) == expected >= 3
    prefill_raw, decode_raw = tensor_bytes(prefill), tensor_bytes(decode)
    wire = b"".join(data for _, data in captured)
    # No run of the activation bytes is in clear anywhere in what the broker carried: not one element row's worth.
    for raw in (prefill_raw, decode_raw):
        for start in range(0, len(raw) - 32, len(raw) // 16):
            assert raw[start:start + 32] not in wire
    for step, raw in ((0, prefill_raw), (1, decode_raw)):
        frames = [(FrameHeader.from_nats_headers(h), d) for h, d in captured if h[HEADER_STEP] == str(step)]
        assert all(HEADER_SEAL in h for h, _ in captured)
        with pytest.raises(FrameError):  # each payload is longer than its chunk: the step does not even assemble
            decode_frames(frames)
        # Cut to the declared sizes, the bytes assemble into a tensor of the right shape, but not the one sent.
        cut = [(header, data[: len(data) - 16]) for header, data in frames]
        _, garbage = decode_frames(cut)
        assert tensor_bytes(garbage) != raw


async def test_unsealed_and_replayed_frames_are_dropped_on_a_sealed_link(connections, eye):
    source, hop = connections
    key, other_link = new_link_key(), new_link_key()
    real = torch.randn(1, 1, 256)
    info = StepInfo(session="s1", step=1, kind=FrameKind.decode, pos=0)
    async with ActivationReceiver(hop, PIPELINE, 0, link_key=key, seal=True) as receiver, \
            ActivationReceiver(hop, PIPELINE, 1, link_key=other_link, seal=True) as next_hop, \
            AckWindowSender(source, PIPELINE, 0, link_key=key, seal=True) as sender:
        # A MAC-only frame made with this very link key (an end that did not agree to seal), and one in clear.
        encoded = encode_step(info, torch.zeros(1, 1, 256))
        headers = encoded.header(PIPELINE, 0, 0).to_nats_headers()
        maced_headers = dict(headers)
        maced = LinkAuth(key, sealed=False).protect_frame(maced_headers, encoded.chunks[0])
        await source.publish(activation_subject(PIPELINE, 0), bytes(maced), headers=maced_headers)
        await source.publish(activation_subject(PIPELINE, 0), bytes(encoded.chunks[0]), headers=dict(headers))
        await flush_ordered(source)
        await sender.send(info, real)
        first = await receiver.next_step(wait_s)
        await sender.wait_all_acked(wait_s)
        assert torch.equal(first.tensor, real)
        assert receiver.stats.unauthenticated_frames == 2 and receiver.stats.unsealed_frames == 2

        # The captured sealed frame replayed as a later step of the same link, and into the next link.
        await eventually(lambda: len(eye.frames) == 3, "the broker's eye saw the sealed frame")
        [(captured, data)] = [(h, d) for h, d in eye.frames if HEADER_SEAL in h]
        await source.publish(activation_subject(PIPELINE, 0), data, headers={**captured, HEADER_STEP: "2"})
        await source.publish(activation_subject(PIPELINE, 1), data, headers={**captured, "Hearth-Hop": "1"})
        await flush_ordered(source)
        await sender.send(StepInfo(session="s1", step=3, kind=FrameKind.decode, pos=1), real * 2)
        second = await receiver.next_step(wait_s)
        await eventually(lambda: next_hop.stats.unauthenticated_frames == 1, "the next link dropped the replay")
    assert second.step == 3 and torch.equal(second.tensor, real * 2)
    assert receiver.stats.unauthenticated_frames == 3 and receiver.stats.unsealed_frames == 2
    assert receiver.stats.steps_received == 2
    assert next_hop.stats.unauthenticated_frames == 1 and next_hop.stats.steps_received == 0


async def test_a_mac_only_link_still_carries_steps_in_clear(connections, eye):
    source, hop = connections
    key = new_link_key()
    tensor = torch.randn(1, 1, 256)
    async with ActivationReceiver(hop, PIPELINE, 0, link_key=key) as receiver, \
            AckWindowSender(source, PIPELINE, 0, link_key=key) as sender:
        await sender.send(StepInfo(session="s1", step=1, kind=FrameKind.decode), tensor)
        received = await receiver.next_step(wait_s)
        await sender.wait_all_acked(wait_s)
    assert torch.equal(received.tensor, tensor)
    await eventually(lambda: eye.frames, "the broker's eye saw the frame")
    [(headers, data)] = eye.frames
    assert HEADER_SEAL not in headers and data == tensor_bytes(tensor)

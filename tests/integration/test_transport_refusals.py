"""A receiver that knows its pipeline (StepLimits) refuses forged frames across a real nats-server before it
allocates anything: a claimed half gigabyte, a huge chunk count, another hidden size or dtype, an empty tensor.
Each refusal is counted; one in the receiver's own session is reported at once; honest steps still come through;
unfinished steps never hold more than two of the largest steps."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from hearth.services.common.metrics import sample_value
from hearth.services.broker.connection import flush_ordered
from hearth.services.transport import (
    AckWindowSender,
    ActivationReceiver,
    FrameHeader,
    FrameKind,
    StepInfo,
    StepLimits,
    StepRefusal,
)
from hearth.services.transport.wire import WireDtype, wire_nbytes

pytestmark = pytest.mark.integration

PIPELINE = "pipe-refusals"
HIDDEN = 64
MAX_TOKENS = 300
SESSION = "s-live"
# An upper bound on a busy machine; the frames are normally taken within milliseconds.
frames_taken_within_s = 30.0
# Every forged frame below claims up to 512 MB; refused before allocation, the process grows by far less.
rss_allowance_bytes = 50 * 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def refused_count(reason: str) -> float:
    return sample_value("hearth_activation_frames_refused_total", {"reason": reason})


def forged(shape, *, step: int, session: str = "s-forged", dtype=WireDtype.float32, chunks: int = 1,
           block: int | None = None, compute: WireDtype | None = None, pos: int = 0) -> dict[str, str]:
    """The headers of chunk 0 of a step that claims `shape` (they pass header validation on their own)."""
    total = wire_nbytes(dtype, shape, block)
    return FrameHeader(pipeline_id=PIPELINE, hop=0, session=session, step=step, kind=FrameKind.prefill, pos=pos,
                       chunk_index=0, chunk_count=chunks, dtype=dtype, compute_dtype=compute or dtype, shape=shape,
                       offset=0, total_bytes=total, int8_block=block).to_nats_headers()


FORGERIES = [
    ("positions", dict(shape=(1, 2_000_000, HIDDEN), chunks=500)),  # 512 MB in 500 chunks
    ("chunks", dict(shape=(1, MAX_TOKENS, HIDDEN), chunks=70_000)),  # a fitting size in 70 000 chunks
    ("shape", dict(shape=(1, 4, HIDDEN + 1))),
    ("shape", dict(shape=(1, 0, HIDDEN))),  # empty
    ("shape", dict(shape=(100_000, 1000))),
    ("dtype", dict(shape=(1, 4, HIDDEN), dtype=WireDtype.int8, block=64, compute=WireDtype.float32)),
]


async def test_forged_frames_are_refused_before_allocation_and_honest_steps_pass(connections):
    source, hop = connections
    limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)
    reported: list[tuple[str, int, StepRefusal]] = []

    async def on_refused(header: FrameHeader, refusal: StepRefusal) -> None:
        reported.append((header.session, header.step, refusal))

    counted_before = {reason: refused_count(reason) for reason, _ in FORGERIES}
    async with ActivationReceiver(hop, PIPELINE, 0, step_limits=limits, on_refused=on_refused) as receiver, \
            AckWindowSender(source, PIPELINE, 0) as sender:
        rss_before = rss_bytes()
        for round_ in range(10):
            for index, (_, claim) in enumerate(FORGERIES):
                await source.publish(receiver.subject, b"\x00" * 64,
                                     headers=forged(step=100 * round_ + index, **claim))
        # One of the live session's steps arrives empty: reported at once, naming the session and step.
        await source.publish(receiver.subject, b"", headers=forged((1, 0, HIDDEN), step=7, session=SESSION))
        activation = torch.randn(1, 5, HIDDEN)
        await sender.send(StepInfo(session=SESSION, step=8, kind=FrameKind.prefill), activation)
        received = await receiver.next_step(frames_taken_within_s)
        rss_after = rss_bytes()

    assert received.step == 8 and torch.equal(received.tensor, activation)
    assert receiver.stats.refused_frames == 10 * len(FORGERIES) + 1
    assert rss_after - rss_before < rss_allowance_bytes, (rss_before, rss_after)
    for reason, _ in FORGERIES:
        expected = 10 * sum(1 for r, _ in FORGERIES if r == reason) + (reason == "shape")
        assert refused_count(reason) - counted_before[reason] == expected
    ours = [(session, step, refusal.reason) for session, step, refusal in reported if session == SESSION]
    assert ours == [(SESSION, 7, "shape")]
    assert "carries no tokens" in reported[-1][2].message


async def test_unfinished_steps_hold_at_most_two_of_the_largest(connections):
    source, hop = connections
    limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)
    largest = (1, MAX_TOKENS, HIDDEN)
    async with ActivationReceiver(hop, PIPELINE, 0, step_limits=limits) as receiver:
        for step in range(50):
            # Chunk 0 of 60 of a step of the largest size, whose other chunks never come.
            await source.publish(receiver.subject, b"\x01" * 1024, headers=forged(largest, step=step, chunks=60))
        await flush_ordered(source)
        async with asyncio.timeout(frames_taken_within_s):
            while receiver.stats.chunks_received < 50:  # the subscription's task takes them in its own time
                await asyncio.sleep(0.01)
        held = sum(partial.assembler.header.total_bytes for partial in receiver._partial.values())
    assert receiver.max_partial_bytes == 2 * limits.max_step_bytes
    assert 0 < held <= receiver.max_partial_bytes
    assert receiver.stats.dropped_steps >= 50 - 2 * limits.max_step_bytes // wire_nbytes(WireDtype.float32, largest)

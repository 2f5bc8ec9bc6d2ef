"""A wait of the transport (and of the steward's removal lookup) that is cancelled in the very turn what it waits for
comes ends cancelled: on Python 3.11 asyncio.wait_for returned the result then and dropped the cancellation, so a
loop stopped by cancellation (a hop's receive loop, a call's sends) went on. Each wait keeps its timeout
(TimeoutError) too. No network: stand-ins for the connections."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from hearth.services import community_removal
from hearth.services.community_removal import BrokerRemovalLog
from hearth.services.transport import ActivationReceiver, FrameKind, StepInfo, encode_step
from hearth.services.transport.acks import AckObserver
from hearth.services.transport.headers import AckHeader
from hearth.services.transport.sender import AckWindowSender

PIPELINE = "pipe-cancel"
HIDDEN = 8
settle_timeout_s = 2.0


class _Connection:
    """What a sender or receiver asks of its NATS connection, without a broker."""

    max_payload = 2**20
    stats = {"reconnects": 0}

    async def publish(self, subject: str, payload: bytes, headers=None) -> None:
        pass


async def _cancelled_as(waiting: asyncio.Task, what_it_waits_for) -> bool:
    """Let `waiting` block, then give it what it waits for and cancel it in the same turn; whether it ended
    cancelled."""
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await what_it_waits_for()
    waiting.cancel()
    await asyncio.wait({waiting}, timeout=settle_timeout_s)
    assert waiting.done()
    return waiting.cancelled()


def _sender(**options) -> AckWindowSender:
    sender = AckWindowSender(_Connection(), PIPELINE, 0, window_chunks=1, **options)  # type: ignore[arg-type]
    sender._in_flight[("s", 1, 0)] = time.perf_counter()  # one chunk out, its ack awaited
    return sender


def _ack_of_the_chunk_out(sender: AckWindowSender):
    header = AckHeader(pipeline_id=PIPELINE, hop=0, session="s", step=1, chunk_index=0, chunk_count=1)
    return lambda: sender._on_ack(SimpleNamespace(headers=header.to_nats_headers(), data=b""))


async def test_a_sender_waiting_for_every_ack_cancelled_as_the_last_comes_ends_cancelled():
    sender = _sender()
    waiting = asyncio.create_task(sender.wait_all_acked(timeout_s=30))
    assert await _cancelled_as(waiting, _ack_of_the_chunk_out(sender))


async def test_a_sender_waiting_for_window_space_cancelled_as_an_ack_frees_it_ends_cancelled():
    sender = _sender()
    waiting = asyncio.create_task(sender._wait_for_space(StepInfo(session="s", step=2, kind=FrameKind.decode), None))
    assert await _cancelled_as(waiting, _ack_of_the_chunk_out(sender))


async def test_a_sender_s_waits_still_time_out():
    sender = _sender(ack_timeout_s=0.05)
    with pytest.raises(TimeoutError):  # TransportTimeout, as before
        await sender.wait_all_acked()
    with pytest.raises(TimeoutError):
        await sender._wait_for_space(StepInfo(session="s", step=2, kind=FrameKind.decode), None)
    await sender._send_lock.acquire()
    with pytest.raises(TimeoutError):
        await sender._acquire_send_lock(StepInfo(session="s", step=2, kind=FrameKind.decode))


async def test_a_wait_for_a_hop_s_ack_cancelled_as_it_comes_ends_cancelled():
    acks = AckObserver(None, PIPELINE)  # type: ignore[arg-type]  # record() never touches the connection
    waiting = asyncio.create_task(acks.wait_for_hop("s", 1, hop=1, timeout_s=30))

    async def ack_of_hop_1() -> None:
        acks.record(AckHeader(pipeline_id=PIPELINE, hop=1, session="s", step=1, chunk_index=0, chunk_count=1))

    assert await _cancelled_as(waiting, ack_of_hop_1)
    with pytest.raises(TimeoutError):  # TransportTimeout
        await acks.wait_for_hop("s", 2, hop=1, timeout_s=0.05)


def _frame(step: int) -> SimpleNamespace:
    encoded = encode_step(StepInfo(session=f"s{step}", step=step, kind=FrameKind.prefill, pos=0),
                          torch.ones(1, 1, HIDDEN))
    return SimpleNamespace(headers=encoded.header(PIPELINE, 1, 0).to_nats_headers(), data=bytes(encoded.chunks[0]))


async def test_a_receiver_holding_a_frame_for_room_cancelled_as_the_consumer_takes_a_step_ends_cancelled():
    receiver = ActivationReceiver(_Connection(), PIPELINE, 1, max_ready_steps=1, ready_wait_timeout_s=30)
    await receiver._on_frame(_frame(1))  # the one place taken
    waiting = asyncio.create_task(receiver._on_frame(_frame(2)))

    async def take_a_step() -> None:
        receiver.take_ready()

    assert await _cancelled_as(waiting, take_a_step)


class _StreamsAnsweringAsTheReaderIsCancelled:
    """A JetStream stand-in whose stream_info cancels the task reading the removals as it answers (an empty
    stream), so the read ends in the turn the cancellation lands."""

    reader: asyncio.Task | None = None

    async def stream_info(self, stream: str):
        self.reader.cancel()
        return SimpleNamespace(state=SimpleNamespace(last_seq=0))


class _StreamsNeverAnswering:
    async def stream_info(self, stream: str):
        await asyncio.sleep(3600)


async def test_reading_the_removals_cancelled_as_the_read_ends_ends_cancelled():
    js = _StreamsAnsweringAsTheReaderIsCancelled()
    reading = asyncio.create_task(BrokerRemovalLog(js, "stand-in").removals("HEARTH_SHARDS"))  # type: ignore[arg-type]
    js.reader = reading
    await asyncio.wait({reading}, timeout=settle_timeout_s)
    assert reading.cancelled()


async def test_reading_the_removals_still_times_out(monkeypatch):
    monkeypatch.setattr(community_removal, "removal_lookup_timeout_s", 0.05)
    with pytest.raises(TimeoutError):
        await BrokerRemovalLog(_StreamsNeverAnswering(), "stand-in").removals("HEARTH_SHARDS")  # type: ignore[arg-type]

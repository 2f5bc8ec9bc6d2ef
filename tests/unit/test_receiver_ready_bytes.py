"""Complete steps waiting for a receiver's consumer hold at most two of the largest steps its pipeline allows, in bytes,
whatever their count may be: a sender holding the link key (the hop before, a member's shard) that ignores the window
and sends step after step of the largest size would otherwise make a shard hold `max_ready_steps` of them per hop, and
an orchestrator's tap (thousands of places, emptied only when the chain's output comes) far more."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hearth.services.transport import ActivationReceiver, FrameKind, StepInfo, StepLimits, encode_step

PIPELINE = "pipe-ready"
HIDDEN = 64
MAX_TOKENS = 300


class _Acks:
    max_payload = 2**20

    async def publish(self, subject: str, payload: bytes, headers=None) -> None:
        pass


def _frames_of(step: int, tokens: int, session: str = "s") -> list[SimpleNamespace]:
    encoded = encode_step(StepInfo(session=session, step=step, kind=FrameKind.prefill, pos=0),
                          torch.ones(1, tokens, HIDDEN))
    return [SimpleNamespace(headers=encoded.header(PIPELINE, 1, index).to_nats_headers(), data=bytes(chunk))
            for index, chunk in enumerate(encoded.chunks)]


def _held_bytes(receiver: ActivationReceiver) -> int:
    return sum(step.tensor.numel() * step.tensor.element_size() for step in receiver._ready)


async def _flood(receiver: ActivationReceiver, steps: int, tokens: int, sessions: str = "s") -> None:
    for step in range(1, steps + 1):
        for frame in _frames_of(step, tokens, session=f"{sessions}{step}"):
            await receiver._on_frame(frame)


async def test_the_largest_steps_wait_for_the_consumer_two_at_most():
    limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)
    receiver = ActivationReceiver(_Acks(), PIPELINE, 1, step_limits=limits, max_ready_steps=8,
                                  ready_wait_timeout_s=0.01)
    await _flood(receiver, 8, MAX_TOKENS)
    assert 1 <= receiver.ready_steps <= 2
    assert _held_bytes(receiver) <= 2 * limits.max_step_bytes
    assert receiver.stats.dropped_steps == 8 - receiver.ready_steps
    # Small steps still take every place: the bound is in bytes, not in steps.
    receiver.take_ready()
    await _flood(receiver, 8, 1, sessions="small")
    assert receiver.ready_steps == 8


async def test_a_tap_holds_no_more_than_a_hop_does():
    limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)
    tap = ActivationReceiver(_Acks(), PIPELINE, 1, step_limits=limits, max_ready_steps=4096, acks=False,
                             ready_wait_timeout_s=0.01)
    await _flood(tap, 20, MAX_TOKENS)
    assert _held_bytes(tap) <= 2 * limits.max_step_bytes


async def test_one_step_of_any_allowed_size_always_finds_room_in_an_empty_queue():
    limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)
    # A float32 step of every position is the largest tensor the pipeline allows: an empty queue takes it.
    receiver = ActivationReceiver(_Acks(), PIPELINE, 1, step_limits=limits, ready_wait_timeout_s=0.01)
    await _flood(receiver, 1, MAX_TOKENS)
    assert receiver.ready_steps == 1 and receiver.stats.dropped_steps == 0

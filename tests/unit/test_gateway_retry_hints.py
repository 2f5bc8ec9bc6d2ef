"""The Retry-After of the gateway's 429s and 503s: spread per answer, in `retry-after-ms` too (which OpenAI's clients
read first), and, at the gateway's own limits on open calls, as long as the calls holding the places are likely to
still run; so that calls refused together, sent again by OpenAI's client with its default retries, are served."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import httpx2
import openai
import pytest

from hearth.protocol.bounds import max_retry_after_s
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import ChatFrame, ErrorFrame
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.errors import GatewayError, from_frame, overloaded
from hearth.services.gateway.keys import Caller
from hearth.services.gateway.mesh import Gateway, MeshCall
from hearth.services.gateway.retry_hints import (
    MAX_ESTIMATED_RETRY_AFTER_S, MIN_RETRY_AFTER_S, RETRY_JITTER, CallDurations,
)
from tests.unit.test_withdrawn_tokens import MODEL, ScriptedCall, ScriptedGateway, done, token

HI = [{"role": "user", "content": "hi"}]
# Longer than the two one-second waits of the old fixed `Retry-After: 1` together.
SLOW_CALL_S = 2.2


def waits_as_named(headers, named_s: float) -> bool:
    """Whether an answer's retry-after-ms and Retry-After suggest the wait `named_s`, spread as every answer's is
    (at least the shortest wait, at most hearth's longest)."""
    wait_s, whole_s = int(headers["retry-after-ms"]) / 1000, int(headers["retry-after"])
    least = max(MIN_RETRY_AFTER_S, named_s)
    most = min(max_retry_after_s, least * (1 + RETRY_JITTER)) + 0.001  # a millisecond's rounding up
    return least <= wait_s <= most and whole_s == math.ceil(wait_s)


def _waits(response) -> tuple[float, int]:
    """The wait an answer suggests in milliseconds (as seconds) and in Retry-After."""
    return int(response.headers["retry-after-ms"]) / 1000, int(response.headers["retry-after"])


def test_a_wait_is_spread_per_answer_never_below_what_was_named_and_given_in_milliseconds_too():
    error = overloaded("full", 3)
    waits = [_waits(error.response()) for _ in range(50)]
    for wait_s, whole_s in waits:
        assert 3 <= wait_s <= 3 * (1 + RETRY_JITTER) and whole_s == math.ceil(wait_s)
    assert len({wait_s for wait_s, _ in waits}) > 40  # refused together, sent back apart
    # A wait the mesh names is the least it asks for; a short one is lengthened to the shortest hearth suggests.
    frame_wait, _ = _waits(from_frame(ErrorFrame(seq=0, code="overloaded", message="queue full",
                                                 retry_after_s=0.01)).response())
    assert frame_wait >= MIN_RETRY_AFTER_S


def test_the_wait_follows_when_an_open_call_is_likely_to_end():
    durations = CallDurations(fallback_s=1.0)
    # No call ended yet: as long again as the oldest open call ran, at least the fallback.
    assert durations.until_one_ends([0.0, 0.2]) == 1.0
    assert durations.until_one_ends([3.0, 5.0]) == 3.0
    for held_s in (4.0, 4.0, 6.0):
        durations.record(held_s)
    assert durations.until_one_ends([1.0, 3.0]) == pytest.approx(1.0)  # typical 4 s, the older one ran 3 of them
    assert durations.until_one_ends([9.0]) == pytest.approx(1.0)  # past the typical: a quarter of it more
    assert durations.until_one_ends([]) == 1.0
    for _ in range(64):
        durations.record(600.0)
    assert durations.until_one_ends([0.0]) == MAX_ESTIMATED_RETRY_AFTER_S
    for _ in range(64):
        durations.record(0.01)
    assert durations.until_one_ends([0.0]) == MIN_RETRY_AFTER_S


def test_a_member_at_its_limit_is_told_to_wait_until_its_own_calls_are_likely_done():
    gateway = Gateway(None, HearthSettings(gateway={"max_open_requests_per_caller": 1}), keyring=None)
    for _ in range(3):
        gateway.call_durations.record(8.0)
    alice, bob = Caller("alice", None), Caller("bob", None)
    with gateway.open_call(alice):
        with pytest.raises(GatewayError) as refused:
            with gateway.open_call(alice):
                pass
        assert refused.value.status == 429 and 7.5 < refused.value.retry_after_s <= 8.0
        wait_s, _ = _waits(refused.value.response())
        assert 7.5 < wait_s <= 8.0 * (1 + RETRY_JITTER)
        with gateway.open_call(bob):  # another member's place is free
            pass


class _SlowCall(ScriptedCall):
    def __init__(self, request: ChatRequest, frames: list[ChatFrame], delay_s: float) -> None:
        super().__init__(request, frames)
        self._frames = self._slowly(frames, delay_s)

    @staticmethod
    async def _slowly(frames: list[ChatFrame], delay_s: float) -> AsyncIterator[ChatFrame]:
        await asyncio.sleep(delay_s)
        for frame in frames:
            yield frame


class _TimedGateway(ScriptedGateway):
    """Each call's answer comes after the next of `delays` (seconds); at most `max_open_requests` calls at once."""

    def __init__(self, max_open_requests: int, delays: list[float]) -> None:
        super().__init__()
        self.settings = HearthSettings(gateway={"max_open_requests": max_open_requests})
        self.delays = delays

    def call(self, request: ChatRequest, caller) -> MeshCall:
        self.received.append(request)
        return _SlowCall(request, [token(0, "ok"), done(1, 1)], self.delays.pop(0))


async def test_calls_refused_together_are_all_served_within_openai_s_default_retries():
    """The gateway's own 429 said `Retry-After: 1` whatever the calls holding the places were doing: with calls of
    a few seconds, the refused ones came back twice while those still ran, and failed (2 of 6 with the pinned
    client's 2 retries, in the demo)."""
    # A first call alone, then four at once for two places: the two refused are served when sent again.
    scripted = _TimedGateway(max_open_requests=2, delays=[SLOW_CALL_S, SLOW_CALL_S, SLOW_CALL_S, 0.0, 0.0])
    transport = httpx2.ASGITransport(app=create_app(scripted))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http)
        assert client.max_retries == 2  # the client's default, as a user has it
        await client.chat.completions.create(model=MODEL, messages=HI)
        answers = await asyncio.gather(*(client.chat.completions.create(model=MODEL, messages=HI)
                                         for _ in range(4)), return_exceptions=True)
        assert not [answer for answer in answers if isinstance(answer, Exception)], answers
        assert [answer.choices[0].message.content for answer in answers] == ["ok"] * 4

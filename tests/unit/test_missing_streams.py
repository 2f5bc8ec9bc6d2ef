"""Whether the event streams exist, as the broker says it: a stream it lacks is missing, one it would not say about
(no answer in time, an error) is unknown and told apart, and a waiting process keeps asking until they exist."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import NoRespondersError
from nats.js.errors import NotFoundError

from hearth.events import streams
from hearth.events.streams import (
    PIPELINES_STREAM,
    SHARDS_STREAM,
    StreamsMissing,
    StreamsUnknown,
    missing_streams,
    wait_for_streams,
)


class ScriptedJetStream:
    """stream_info answering from a script per stream: an exception to raise, a coroutine's sleep, or info."""

    def __init__(self, answers: dict[str, list]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def stream_info(self, name: str):
        self.asked.append(name)
        answer = self.answers[name].pop(0) if len(self.answers[name]) > 1 else self.answers[name][0]
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, float):
            await asyncio.sleep(answer)
        return object()


async def test_a_stream_the_broker_lacks_is_missing_and_one_it_holds_is_not():
    js = ScriptedJetStream({SHARDS_STREAM: [None], PIPELINES_STREAM: [NotFoundError()]})
    assert await missing_streams(js, [SHARDS_STREAM, PIPELINES_STREAM]) == [PIPELINES_STREAM]


async def test_a_broker_that_does_not_say_is_not_taken_for_a_missing_stream(monkeypatch):
    monkeypatch.setattr(streams, "stream_info_timeout_s", 0.05)
    silent = ScriptedJetStream({SHARDS_STREAM: [1.0]})
    with pytest.raises(StreamsUnknown, match=f"did not say whether the event stream {SHARDS_STREAM} exists "
                                             r"\(no answer within 0.05 s\)"):
        await missing_streams(silent, [SHARDS_STREAM])
    refusing = ScriptedJetStream({SHARDS_STREAM: [NoRespondersError()]})
    with pytest.raises(StreamsUnknown, match="no responders"):
        await missing_streams(refusing, [SHARDS_STREAM])
    assert issubclass(StreamsUnknown, StreamsMissing)  # every command that refuses on a missing stream refuses too


async def test_a_waiting_process_asks_again_until_the_streams_exist_and_says_why_it_waits(monkeypatch):
    monkeypatch.setattr(streams, "streams_poll_interval_s", 0.01)
    js = ScriptedJetStream({SHARDS_STREAM: [NoRespondersError(), NotFoundError(), None]})
    await asyncio.wait_for(wait_for_streams(js, [SHARDS_STREAM], wait_s=None), timeout=10)
    assert js.asked == [SHARDS_STREAM] * 3
    never = ScriptedJetStream({SHARDS_STREAM: [NoRespondersError()]})
    with pytest.raises(StreamsMissing, match="did not say whether the event stream"):
        await wait_for_streams(never, [SHARDS_STREAM], wait_s=0.05)

"""A process measures its clock against the broker's (the `ts` of a stream-info answer) and, beyond [events]
max_clock_skew_s, says so in one line naming itself, how far and which way; once a while, not at every check."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from hearth.events.broker_clock import BrokerClockWatch, broker_time_s

BROKER_S = 1_796_565_501.0
LOGGER = "hearth.events.broker_clock"


class BrokerAnswering:
    """A connection whose stream-info answers carry the broker's time `BROKER_S` (or `answer`, verbatim)."""

    def __init__(self, answer: bytes | None = None) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def request(self, subject: str, payload: bytes, timeout: float):
        self.asked.append(subject)
        return SimpleNamespace(data=self.answer or b'{"type": "io.nats.jetstream.api.v1.stream_info_response", '
                                                   b'"ts": "2026-12-06T13:58:21.933377382Z"}')


def test_the_brokers_time_is_read_to_the_nanosecond_or_not_at_all():
    assert broker_time_s(b'{"ts": "2026-12-06T13:58:21.933377382Z"}') == BROKER_S + 0.933377382
    assert broker_time_s(b'{"ts": "2026-12-06T14:58:21+01:00"}') == BROKER_S
    for junk in (b'{"error": {"code": 503}}', b'{"ts": 5}', b'{"ts": "yesterday"}', b"[]", b"not json",
                 b'{"ts": "2026-12-06T13:58:21.' + b"9" * 5000 + b'Z"}'):
        assert broker_time_s(junk) is None


def watch(offset_s: float, now: list[float], nc=None) -> BrokerClockWatch:
    return BrokerClockWatch(nc or BrokerAnswering(), "HEARTH_SHARDS", member="shard host h1", max_clock_skew_s=30,
                            consequence="its shards are not routed", report_every=900,
                            clock=lambda: BROKER_S + 0.933377382 + offset_s, monotonic=lambda: now[0])


async def test_a_clock_far_off_is_told_once_a_while_naming_the_member_and_the_way(caplog):
    now = [0.0]
    ahead = watch(300.0, now)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for now[0] in (0.0, 60.0, 120.0, 900.0):
            assert round(await ahead.check()) == 300
    lines = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert lines == ["shard host h1's clock is about 300 s ahead of the broker's clock (at most 30 s allowed): its "
                     "shards are not routed; set it by NTP"] * 2


async def test_a_clock_within_the_limit_says_nothing_and_one_set_right_says_so_once(caplog):
    now, offset = [0.0], [-29.0]
    clock = BrokerClockWatch(BrokerAnswering(), "HEARTH_SHARDS", member="orchestrator hub", max_clock_skew_s=30,
                             consequence="calls are refused", clock=lambda: BROKER_S + 0.933377382 + offset[0],
                             monotonic=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        await clock.check()
        assert not caplog.records
        offset[0] = -3600.0
        await clock.check()
        offset[0] = 1.0
        await clock.check()
        await clock.check()
    lines = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(lines) == 2 and "about 3600 s behind the broker's clock" in lines[0]
    assert lines[1].startswith("orchestrator hub's clock is back within 30 s of the broker's")


async def test_a_broker_that_does_not_say_its_time_is_not_measured(caplog):
    nc = BrokerAnswering(b'{"type": "io.nats.jetstream.api.v1.stream_info_response"}')
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await watch(300.0, [0.0], nc).check() is None
    assert nc.asked == ["$JS.API.STREAM.INFO.HEARTH_SHARDS"] and not caplog.records

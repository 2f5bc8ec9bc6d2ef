"""Measures this process's clock against the broker's, whose storage times every projector dates events by, and says
in one line (once a while, hearth/events/clock_skew.py) when it is off beyond `[events] max_clock_skew_s`: the
member whose clock is wrong is told so itself, rather than only seeing its shards unrouted or its opens refused.

The broker's time is the `ts` of a JetStream stream-info answer (nats-server 2.10 and later), which every member
that reads a stream may ask for (broker/permissions.py, stream_reading); the offset is this clock at the midpoint of
the request less that time, so its error is at most half the round trip. The latest offset is exported as
`hearth_broker_clock_offset_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from datetime import datetime

from hearth.events.cancellation import keeping_cancellation
from hearth.events.clock_skew import report_every_s, skew_in_words
from hearth.events.metrics import broker_clock_offset_seconds

log = logging.getLogger(__name__)

check_every_s = 60.0
request_timeout_s = 2.0
# RFC 3339 as nats-server writes it: up to nanoseconds, which datetime does not hold; a bounded pattern.
_BROKER_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")


def broker_time_s(answer: bytes) -> float | None:
    """The broker's time (unix s) in a stream-info answer, or None when it holds none (an older nats-server, an
    error answer, anything else)."""
    try:
        stamp = json.loads(answer).get("ts")
    except (ValueError, AttributeError):
        return None
    matched = _BROKER_TIME.match(stamp) if isinstance(stamp, str) and len(stamp) <= 40 else None
    if matched is None:
        return None
    whole, fraction, zone = matched.groups()
    try:
        seconds = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    except ValueError:
        return None
    return seconds + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


async def broker_clock_offset_s(nc, stream: str, *, clock: Callable[[], float] = time.time,
                                timeout_s: float = request_timeout_s) -> float | None:
    """This clock less the broker's, in s (positive: this one is ahead), asked with `stream`'s info; None when the
    broker does not say its time."""
    before = clock()
    answer = await keeping_cancellation(nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=timeout_s))
    after = clock()
    broker_s = broker_time_s(answer.data)
    return None if broker_s is None else (before + after) / 2 - broker_s


class BrokerClockWatch:
    """Every `every_s`, measures this process's clock against the broker's; beyond `max_clock_skew_s` it logs a
    warning naming `member` (how far, which way, what it breaks), again after `report_every` only, and once when the
    clock is back within the limit."""

    def __init__(self, nc, stream: str, *, member: str, max_clock_skew_s: float, consequence: str,
                 every_s: float = check_every_s, report_every: float = report_every_s,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._nc, self._stream, self.member = nc, stream, member
        self.max_clock_skew_s, self.consequence = max_clock_skew_s, consequence
        self._every_s, self._report_every = every_s, report_every
        self._clock, self._monotonic = clock, monotonic
        self._told_at: float | None = None
        self._task: asyncio.Task | None = None
        self.offset_s: float | None = None

    async def check(self) -> float | None:
        """Measure once and say what it found if that is news; the offset (None: not measured)."""
        try:
            offset_s = await broker_clock_offset_s(self._nc, self._stream, clock=self._clock)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the broker reconnecting or slow: measured next time
            log.debug("the broker's clock not read (%s: %s)", type(error).__name__, error)
            return None
        if offset_s is None or not math.isfinite(offset_s):
            return None
        self.offset_s = offset_s
        broker_clock_offset_seconds.set(offset_s)
        now = self._monotonic()
        if abs(offset_s) > self.max_clock_skew_s:
            if self._told_at is None or now - self._told_at >= self._report_every:
                self._told_at = now
                log.warning("%s's clock is %s (at most %g s allowed): %s; set it by NTP", self.member,
                            skew_in_words(offset_s, "the broker's clock"), self.max_clock_skew_s, self.consequence)
        elif self._told_at is not None:
            self._told_at = None
            log.warning("%s's clock is back within %g s of the broker's (%s)", self.member, self.max_clock_skew_s,
                        skew_in_words(offset_s, "it"))
        return offset_s

    async def run(self) -> None:
        """Check now and every `every_s` until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self._every_s)

    def start(self) -> None:
        """Run in the background until `stop`."""
        self._task = asyncio.create_task(self.run(), name="broker-clock-watch")

    async def stop(self) -> None:
        """End what `start` began (at most a request's timeout, should a request be under way)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            async with asyncio.timeout(request_timeout_s):
                await task

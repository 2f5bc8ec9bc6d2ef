"""Says that a member's clock is off, in one line naming how far, which way and by whose clock it was measured, once
per member and quarter of an hour rather than once per refused call, `open` or event, and counts every message
dated beyond the limit (hearth_skewed_clock_messages_total)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from hearth.events.metrics import skewed_clock_messages_total
from hearth.events.once_a_while import OnceAWhile

log = logging.getLogger(__name__)

SkewedMessage = Literal["call", "open", "event"]
report_every_s = 900.0
# A member is a roster name (or, on an open mesh, any node id an event claims): the memory of whom was told is bounded.
max_remembered_members = 1024


def skew_in_words(skew_s: float, clock: str) -> str:
    """`skew_s` (the message's date less `clock`'s time) in words: "about 300 s ahead of the broker's clock"."""
    return f"about {abs(skew_s):.0f} s {'ahead of' if skew_s > 0 else 'behind'} {clock}"


class ClockSkewReports:
    """Logs a warning the first time a member's message is dated beyond `[events] max_clock_skew_s` of the clock that
    checks it, and again only after `every_s` (a clock hovering about the limit is not told at every crossing);
    every such message is counted."""

    def __init__(self, *, every_s: float = report_every_s, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._told = OnceAWhile(every_s, max_remembered_members, monotonic=monotonic)

    def skewed(self, what: SkewedMessage, member: str, skew_s: float, *, clock: str, allowed_s: float,
               consequence: str) -> bool:
        """Count one message of `member` dated `skew_s` off `clock`; log it unless told lately. True: logged."""
        skewed_clock_messages_total.labels(what).inc()
        if not self._told.due(member):
            return False
        log.warning("%s's clock is %s (by the date of its %s; at most %g s allowed): %s; set both clocks by NTP "
                    "(told once every %.0f min)", member, skew_in_words(skew_s, clock), what, allowed_s, consequence,
                    self._told.every_s / 60)
        return True

"""How long a refused call is told to wait before it is sent again: a wait spread at random per answer (so calls
refused together do not all come back together), and, for a refusal at the gateway's own limits on open calls, one
that follows when a call holding a place is likely to end (CallDurations)."""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Iterable

from hearth.protocol.bounds import max_retry_after_s

# The shortest wait any answer suggests: a client sent back sooner would mostly be refused again.
MIN_RETRY_AFTER_S = 0.5
# The longest wait the gateway's own estimate suggests (a wait a refusal of the mesh names may be longer): well under
# the 120 s past which OpenAI's clients give up rather than wait.
MAX_ESTIMATED_RETRY_AFTER_S = 20.0
# A wait is made longer by a random part of up to this share of it, never shorter: a wait the mesh names is the
# least it asks for.
RETRY_JITTER = 0.5
# How many recent calls' durations the estimate is taken from.
RECENT_CALLS = 64


def spread(retry_after_s: float, rng: random.Random | None = None) -> float:
    """`retry_after_s` (at least MIN_RETRY_AFTER_S) plus a random part of up to RETRY_JITTER of it, at most
    hearth's longest wait (protocol.bounds.max_retry_after_s)."""
    base = max(MIN_RETRY_AFTER_S, retry_after_s)
    return min(max_retry_after_s, base * (1 + RETRY_JITTER * (rng or random).random()))


class CallDurations:
    """How long the gateway's recent calls held their place (from taking it to the answer's last byte), and from
    that how long until one of the calls open now is likely to end."""

    def __init__(self, fallback_s: float) -> None:
        # The wait suggested while no call has ended yet and none has run longer ([gateway] retry_after_s).
        self.fallback_s = fallback_s
        self._recent: deque[float] = deque(maxlen=RECENT_CALLS)

    def record(self, held_s: float) -> None:
        self._recent.append(max(0.0, held_s))

    def typical_s(self) -> float | None:
        """The median of the recent calls' durations; None before any call ended."""
        return statistics.median(self._recent) if self._recent else None

    def until_one_ends(self, elapsed_s: Iterable[float]) -> float:
        """How long until the first of the open calls that have run `elapsed_s` is likely to end, within
        MIN_RETRY_AFTER_S and MAX_ESTIMATED_RETRY_AFTER_S: a call is expected to take the typical duration; one that
        took longer than that a quarter of it more; with no duration known yet, as long again as it has run (at
        least `fallback_s`)."""
        typical = self.typical_s()

        def remaining(elapsed: float) -> float:
            if typical is None:
                return max(elapsed, self.fallback_s)
            return max(typical - elapsed, typical / 4)

        soonest = min((remaining(elapsed) for elapsed in elapsed_s), default=self.fallback_s)
        return min(MAX_ESTIMATED_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, soonest))

"""ShardLoad: this orchestrator's live knowledge of each shard, for routing and waiting: how much room it has,
and the round trip to it as measured here.

Heartbeats are seconds old, so routing does not trust their `active_streams`: what this orchestrator knows
now is the streams it holds on each shard itself (a chain opened and not yet closed) and which shards just
refused it `at_capacity` (other orchestrators hold the rest). A shard has room when we hold fewer streams than
it serves and it has not refused us since, while we held as many as now, within `retry_s`. The shard itself
enforces its limit (it refuses an open beyond it), so several orchestrators never overcommit one; a refusal
only teaches us to route around it or to wait. `wait_for_room` wakes on any of our streams ending.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from hearth.readmodels.queries import ShardCandidate
from hearth.services.common.lifecycle import event_within

# Weight of a new round-trip measurement in the running average (one slow answer moves it a quarter).
round_trip_smoothing = 0.25


class ShardLoad:
    """Streams held per shard, recent `at_capacity` refusals, and a wake-up for calls waiting for room."""

    def __init__(self, *, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self._clock = clock
        self._held: dict[str, int] = {}
        # shard_id -> (when it refused us, streams we held on it then)
        self._refused: dict[str, tuple[float, int]] = {}
        self._released = asyncio.Event()
        # shard_id -> smoothed control round trip in seconds (opening a hop), measured by this orchestrator
        self._round_trip_s: dict[str, float] = {}

    def observe_round_trip(self, shard_id: str, seconds: float) -> None:
        """A control request to the shard (opening a hop) took `seconds` from asking to its answer."""
        previous = self._round_trip_s.get(shard_id)
        self._round_trip_s[shard_id] = seconds if previous is None else (
            previous + round_trip_smoothing * (seconds - previous))

    def round_trip_ms(self, shard_id: str) -> float | None:
        """The smoothed measured round trip to the shard, in ms; None before the first."""
        seconds = self._round_trip_s.get(shard_id)
        return None if seconds is None else seconds * 1000.0

    def held(self, shard_id: str) -> int:
        """Streams of this orchestrator open on the shard now."""
        return self._held.get(shard_id, 0)

    def hold(self, shard_ids: Iterable[str]) -> None:
        for shard_id in shard_ids:
            self._held[shard_id] = self._held.get(shard_id, 0) + 1

    def release(self, shard_ids: Iterable[str]) -> None:
        for shard_id in shard_ids:
            left = self._held.get(shard_id, 0) - 1
            if left > 0:
                self._held[shard_id] = left
            else:
                self._held.pop(shard_id, None)
        # Wake every waiting call (each re-plans); a new event for the next round of waiters.
        self._released.set()
        self._released = asyncio.Event()

    def refused(self, shard_id: str) -> None:
        """The shard answered `at_capacity`: it is full until one of our streams on it ends or `retry_s` passes."""
        self._refused[shard_id] = (self._clock(), self.held(shard_id))

    def refused_recently(self, shard_id: str) -> bool:
        """Whether the shard answered `at_capacity` under `retry_s` ago and none of our streams on it ended since."""
        refusal = self._refused.get(shard_id)
        return (refusal is not None and self._clock() - refusal[0] < self.retry_s
                and self.held(shard_id) >= refusal[1])

    def has_room(self, shard: ShardCandidate) -> bool:
        if self.held(shard.shard_id) >= shard.max_concurrent_streams or self.refused_recently(shard.shard_id):
            return False
        self._refused.pop(shard.shard_id, None)  # a refusal that no longer holds
        return True

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until one of our streams ends (a shard may have room again), at most `timeout_s`."""
        await event_within(self._released, timeout_s)  # a call cancelled meanwhile (its client left) ends here

"""RecentFailures: shards this orchestrator just saw stall or corrupt, kept out of routing for a while.

The read model drops a shard only when its heartbeats stop for the health timeout; a shard that is frozen
(SIGSTOP), overloaded or corrupting may keep its last heartbeat fresh for that long, or keep beating. Without
this memory every new request would try it again, and pay a step timeout (or an `open` timeout) to learn
what the previous request already knew. Entries expire after `penalty_s` (the health timeout by default), so
a shard that recovers is routed to again.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RecentFailures:
    """shard_id -> when it may be routed to again; shared by every request of one orchestrator."""

    def __init__(self, penalty_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.penalty_s = penalty_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def add(self, shard_id: str) -> None:
        self._until[shard_id] = self._clock() + self.penalty_s

    def current(self) -> set[str]:
        """The shards still penalised (expired entries are forgotten)."""
        now = self._clock()
        for shard_id in [s for s, until in self._until.items() if until <= now]:
            del self._until[shard_id]
        return set(self._until)

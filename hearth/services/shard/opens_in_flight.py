"""OpensInFlight: how many `open`s of each opener a shard is still answering, bounded, so that no member parks
requests on it faster than it can answer them.

A shard answers each control request in a task of its own, and an `open` may wait for the compute thread (the hop it
re-opens is reset there, its kept prefix attached there) and then for the broker (its subscriptions). Opens that take
a place beyond the opener's share are refused at once, but a re-open of the opener's own hop takes none: without this
bound, a burst of signed re-opens while a long step runs would each hold a task, a hop and its `open` (up to 8192 block
names) until they drained one by one. An opener never needs more opens in progress than the shard has streams.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

from hearth.protocol.control import ControlReply


class OpensInFlight:
    """The opens in progress per opener (the roster member that signed them; None on an open mesh: all are one)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: Counter[str | None] = Counter()

    async def answer(self, opener: str | None, open_hop: Callable[[], Awaitable[ControlReply]]) -> ControlReply:
        """`open_hop()`'s answer, counted as in progress meanwhile; refused `at_capacity` at once when `opener` has
        `limit` opens in progress already."""
        if self._counts[opener] >= self.limit:
            return ControlReply(ok=False, code="at_capacity",
                                message=f"{self._counts[opener]} opens of this orchestrator are in progress here, "
                                        "its most")
        self._counts[opener] += 1
        try:
            return await open_hop()
        finally:
            self._counts[opener] -= 1
            if not self._counts[opener]:
                del self._counts[opener]

"""Expiry of what the orchestrator keeps per conversation beside its shards' kept prefixes (kept inputs, kept chains'
block names): an entry unused for the shards' `[shard] prefix_cache_idle_s` (as this orchestrator's settings give it)
stands for blocks its shards have dropped, so it is dropped too, lazily on access and by a periodic sweep, and memory
comes back after a burst of conversations instead of staying up to its cap.

An entry's clock starts when it is kept and again at each use, as a shard's does (a later turn keeps its whole
history again, so a live conversation's entries stay); kept when the call ends, after its hops kept the blocks, an
entry goes no earlier than the blocks do.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

# The sweep's longest pause: memory comes back within this of the shards' dropping the blocks, however long they keep.
max_sweep_interval_s = 60.0
# Entries one sweep pass drops before giving the event loop a turn (a kept chain remembers up to 65 536 names).
sweep_batch = 4096


@dataclass(frozen=True)
class IdleExpiry:
    """When an entry last used at some time on `clock` has expired: `idle_s` unused (None: never, by time)."""

    idle_s: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic)

    def expired(self, last_used_s: float, now_s: float) -> bool:
        return self.idle_s is not None and now_s - last_used_s > self.idle_s


def pop_expired(entries: OrderedDict[str, Any], last_used_s: Callable[[Any], float], expiry: IdleExpiry,
                limit: int | None = None) -> list[tuple[str, Any]]:
    """Pop the expired entries off the front of `entries` (kept least recently used first, so the first unexpired
    one ends the search), at most `limit` of them; what was popped."""
    popped: list[tuple[str, Any]] = []
    if expiry.idle_s is None:
        return popped
    now_s = expiry.clock()
    while entries and (limit is None or len(popped) < limit):
        key, value = next(iter(entries.items()))
        if not expiry.expired(last_used_s(value), now_s):
            break
        popped.append(entries.popitem(last=False))
    return popped


class Expiring(Protocol):
    def drop_expired(self, limit: int | None = None) -> int: ...


def sweep_interval_s(idle_s: float) -> float:
    """How often the sweep runs for shards that keep blocks `idle_s` unused: half that, within 1 s and
    `max_sweep_interval_s`."""
    return min(max(idle_s / 2, 1.0), max_sweep_interval_s)


async def sweep_expired(holders: Iterable[Expiring], every_s: float) -> None:
    """Every `every_s`, drop each holder's expired entries (`sweep_batch` at a time, yielding between); runs until
    cancelled (the orchestrator's task set owns it)."""
    holders = list(holders)
    while True:
        await asyncio.sleep(every_s)
        for holder in holders:
            while holder.drop_expired(sweep_batch) >= sweep_batch:
                await asyncio.sleep(0)

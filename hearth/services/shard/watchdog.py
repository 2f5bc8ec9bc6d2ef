"""A shard's hop watchdog: every round it evicts the caches of idle sessions and closes the hops whose orchestrator
went silent; a failure is logged and never ends it. While no hop is open it waits for one to open, looking at the
caches only as often as their idle timeouts need: an idle shard host is not woken several times a second."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from hearth.services.common.lifecycle import event_within, log_failure
from hearth.services.shard.hops import HopLimits, ServedHop

log = logging.getLogger(__name__)


async def watch_hops(hops: Mapping[str, ServedHop], limits: HopLimits, evict_idle: Callable[[], Awaitable[object]],
                     close_expired: Callable[[str, ServedHop, str], Awaitable[None]], *, hop_opened: asyncio.Event,
                     cache_idle_s: float) -> None:
    """Until cancelled, a round every quarter of the shorter of the idle and orphan timeouts: `evict_idle()`, then
    `close_expired(pipeline_id, hop, reason)` for each hop of `hops` that has expired (ServedHop.expiry_reason). While
    `hops` is empty, the next round comes once `hop_opened` is set or after a quarter of `cache_idle_s` (the shortest
    time a cache is kept unused: a session's or a kept prefix's), whichever is first."""
    interval_s = min(limits.orphan_timeout_s, limits.idle_timeout_s) / 4
    quiet_interval_s = max(interval_s, cache_idle_s / 4)
    while True:
        if hops:
            await asyncio.sleep(interval_s)
        else:
            hop_opened.clear()
            if await event_within(hop_opened, quiet_interval_s):
                continue  # its orphan timeout starts now: the next round is a whole interval away
        try:
            await evict_idle()
        except Exception as error:  # a runner closed at shutdown, most often: the next round tries again
            log_failure(log, "idle eviction", error, logging.DEBUG)
        now = time.monotonic()
        for pipeline_id, hop in list(hops.items()):
            reason = hop.expiry_reason(now)
            if reason is None:
                continue
            try:
                await close_expired(pipeline_id, hop, reason)
            except Exception as error:  # one hop's failed close: the others, and later rounds, still close theirs
                log_failure(log, f"closing the expired hop of pipeline {pipeline_id}", error)

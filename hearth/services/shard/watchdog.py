"""A shard's hop watchdog: every round it evicts the caches of idle sessions and closes the hops whose orchestrator
went silent; a failure is logged and never ends it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from hearth.services.common.lifecycle import log_failure
from hearth.services.shard.hops import HopLimits, ServedHop

log = logging.getLogger(__name__)


async def watch_hops(hops: Mapping[str, ServedHop], limits: HopLimits, evict_idle: Callable[[], Awaitable[object]],
                     close_expired: Callable[[str, ServedHop, str], Awaitable[None]]) -> None:
    """Until cancelled, a round every quarter of the shorter of the idle and orphan timeouts: `evict_idle()`, then
    `close_expired(pipeline_id, hop, reason)` for each hop of `hops` that has expired (ServedHop.expiry_reason)."""
    interval_s = min(limits.orphan_timeout_s, limits.idle_timeout_s) / 4
    while True:
        await asyncio.sleep(interval_s)
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

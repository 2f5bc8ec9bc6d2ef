"""HopClosing: how a ShardServer stops counting a hop as open (under its `_hop_changes` lock) and closes it outside
that lock, whoever asked: a `close`, a re-open after a failover, the watchdog, a stop."""

from __future__ import annotations

import asyncio
import logging

from hearth.protocol.control import PrefixBlocks
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.hops import ServedHop

# The server's logger: these lines are the server's, as they were before they moved here.
log = logging.getLogger("hearth.services.shard.server")


class HopClosing:
    """Mixed into ShardServer: its hops by pipeline id, the lock their changes take, and their closing."""

    _hops: dict[str, ServedHop]
    _hop_changes: asyncio.Lock
    compute: ShardCompute

    async def _close_expired(self, pipeline_id: str, hop: ServedHop, reason: str) -> None:
        """Close a hop the watchdog found expired (hearth/services/shard/hops.py), unless it was re-opened meanwhile."""
        async with self._hop_changes:
            detached = self._detach_hop(pipeline_id) if self._hops.get(pipeline_id) is hop else None
        if detached is not None:
            log.info("pipeline %s: %s; closing its hop", pipeline_id, reason)
            await self._finish_closing(pipeline_id, detached)

    async def _close_hop(self, pipeline_id: str) -> None:
        hop = self._detach_hop(pipeline_id)
        if hop is not None:
            await self._finish_closing(pipeline_id, hop)

    def _detach_hop(self, pipeline_id: str) -> ServedHop | None:
        """Stop counting a hop as open (call under `_hop_changes`); `_finish_closing` then closes it."""
        hop = self._hops.pop(pipeline_id, None)
        self.compute.active_streams = len(self._hops)
        return hop

    async def _finish_closing(self, pipeline_id: str, hop: ServedHop, keep: PrefixBlocks | None = None) -> None:
        # Its open ends first (it may still wait for the compute thread): its prefix is attached before the session's
        # cache is freed, never after. Bounded as that open's own compute-thread wait is; set even if it failed.
        await hop.open_settled.wait()
        kept = await hop.close(keep)
        log.info("closed pipeline %s (%d positions kept for later calls)", pipeline_id, kept)

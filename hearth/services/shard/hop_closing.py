"""HopClosing: how a ShardServer stops counting a hop as open (under its `_hop_changes` lock) and closes it outside
that lock, whoever asked: a `close`, a re-open after a failover, the watchdog, a stop, or the event log's removal (or
key rotation) of the member whose key opened it.

A removal read from the log (hearth/services/common/logged_steward_keys.py) drops at once what the removed key's opens
left here: its hops are closed (their KV freed; the step in progress is told `session_evicted` with the reason, so an
orchestrator a broker still admits re-opens, and its re-open is refused `unauthorized`), and every prefix the member's
hops kept is dropped, on a rotation too (what the old key's hops kept is not the new key's to start from). Before,
they stayed until idle (`[shard] prefix_cache_idle_s`), holding memory and KV budget."""

from __future__ import annotations

import asyncio
import logging

from hearth.events.models import MemberRemoved
from hearth.protocol.control import PrefixBlocks
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.hops import ServedHop

# The server's logger: these lines are the server's, as they were before they moved here.
log = logging.getLogger("hearth.services.shard.server")


class HopClosing:
    """Mixed into ShardServer: its hops by pipeline id, the lock their changes take, and their closing."""

    _hops: dict[str, ServedHop]
    _hop_changes: asyncio.Lock
    compute: ShardCompute
    steward_keys: StewardKeysFromTheLog | None

    def _retired(self, opener_key: str | None) -> bool:
        """Whether the event log retired the key an open was signed with (False on an open mesh)."""
        keys = self.steward_keys
        return opener_key is not None and keys is not None and opener_key in keys.retired_keys()

    async def _drop_retired_opener(self, removal: MemberRemoved) -> None:
        """Close every hop opened with the key `removal` retired, and drop the prefixes its member's hops kept."""
        async with self._hop_changes:
            dropped = [(pipeline_id, self._detach_hop(pipeline_id)) for pipeline_id, hop in list(self._hops.items())
                       if hop.opener_key == removal.public_key]
        why = f"the member that opened it ({removal.member}) was removed from the community, or its key rotated"
        for pipeline_id, hop in dropped:
            if hop is None:
                continue
            log.info("pipeline %s: %s (the event log says so); closing its hop", pipeline_id, why)
            await hop.tell_dropped(f"dropped: {why}")
            await self._finish_closing(pipeline_id, hop)
        freed = await self.compute.drop_kept_prefixes(removal.member)
        if dropped or freed:
            log.info("dropped %d hops and %d bytes of kept prefixes of %s: its key was retired (the event log says so)",
                     len(dropped), freed, removal.member)

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
        # Nothing kept for a key the log retired (its kept prefixes were dropped, or are about to be).
        kept = await hop.close(None if self._retired(hop.opener_key) else keep)
        log.info("closed pipeline %s (%d positions kept for later calls)", pipeline_id, kept)

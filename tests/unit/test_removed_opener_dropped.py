"""A shard host that reads a member's removal (or key rotation) from the event log drops at once what that key's opens
left there: its hops are closed (their KV freed, the step in flight told `session_evicted` with the reason), a hop it
asks to keep keeps nothing, a re-open racing the removal is refused, and every prefix the member's hops kept is dropped.
Before, they stayed until idle (`[shard] prefix_cache_idle_s`, 600 s), holding memory and KV budget."""

from __future__ import annotations

import asyncio

import torch

from hearth.events.models import MemberRemoved
from hearth.events.streams import SHARDS_STREAM
from hearth.inference.prefix_cache import PrefixCache
from hearth.protocol.control import OpenHop, PrefixBlocks
from hearth.services.common.config import HearthSettings
from hearth.services.shard.identity import ShardIdentity
from hearth.services.shard.server import ShardServer

REMOVED_KEY, OTHER_KEY = "U" + "A" * 55, "U" + "B" * 55


class _Connection:
    def jetstream(self):
        return object()


class _Compute:
    active_streams = 0

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def drop_kept_prefixes(self, opener: str) -> int:
        self.dropped.append(opener)
        return 4096


class _Hop:
    def __init__(self, opener: str, opener_key: str) -> None:
        self.opener, self.opener_key = opener, opener_key
        self.open_settled = asyncio.Event()
        self.open_settled.set()
        self.told: list[str] = []
        self.closed_with: list[PrefixBlocks | None] = []

    async def tell_dropped(self, message: str) -> None:
        self.told.append(message)

    async def close(self, keep: PrefixBlocks | None = None) -> int:
        self.closed_with.append(keep)
        return 0


class _Follower:
    def __init__(self) -> None:
        self.retired: set[str] = set()
        self.retirement_listeners: list = []

    def retired_keys(self) -> frozenset[str]:
        return frozenset(self.retired)


def _server() -> tuple[ShardServer, _Compute, _Follower]:
    identity = ShardIdentity(shard_id="s", model_id="m", node_id="n", weights_sha256="w", layer_lo=0, layer_hi=3,
                             total_layers=8, dtype="float32", memory_required_mb=1.0, control_subject="hearth.ctl.n.s")
    compute = _Compute()
    server = ShardServer(_Connection(), compute, identity, HearthSettings())
    server.steward_keys = follower = _Follower()
    return server, compute, follower


def _removal(member: str = "hub2") -> MemberRemoved:
    return MemberRemoved(node_id="system", member=member, public_key=REMOVED_KEY, stream=SHARDS_STREAM)


async def test_a_removed_openers_hops_are_closed_and_its_kept_prefixes_dropped():
    server, compute, follower = _server()
    removed, other = _Hop("hub2", REMOVED_KEY), _Hop("hub", OTHER_KEY)
    server._hops.update({"p-removed": removed, "p-other": other})
    follower.retired.add(REMOVED_KEY)
    await server._drop_retired_opener(_removal())
    assert list(server._hops) == ["p-other"] and not other.closed_with
    assert removed.closed_with == [None]  # closed, its session's cache freed, nothing kept
    assert removed.told and "hub2" in removed.told[0] and "removed" in removed.told[0]
    assert compute.dropped == ["hub2"]


async def test_a_close_or_open_of_a_retired_key_after_the_removal_keeps_and_opens_nothing():
    server, _, follower = _server()
    hop = _Hop("hub2", REMOVED_KEY)
    follower.retired.add(REMOVED_KEY)
    await server._finish_closing("p", hop, PrefixBlocks(hashes=["a" * 32], block_tokens=16))
    assert hop.closed_with == [None]
    request = OpenHop(pipeline_id="p", session_id="s", hop=0, hop_count=1, model_id="m", weights_sha256="w",
                      layer_lo=0, layer_hi=3, max_session_tokens=64)
    refused = server._reserve_hop(request, "hub2", REMOVED_KEY)
    assert refused.ok is False and refused.code == "unauthorized" and "removed" in refused.message
    assert not server._hops


def test_a_prefix_cache_drops_the_entries_one_openers_hops_kept():
    cache = PrefixCache(ttl_s=600.0, clock=lambda: 0.0)
    kv = {0: (torch.zeros(1, 1, 16, 4), torch.zeros(1, 1, 16, 4))}
    cache.put(["k-removed"], kv, 16, opener="hub2")
    cache.put(["k-other"], {0: (torch.zeros(1, 1, 16, 4), torch.zeros(1, 1, 16, 4))}, 16, opener="hub")
    assert cache.drop_opener("hub2") > 0
    assert cache.lookup(["k-removed"]) is None and cache.lookup(["k-other"]) is not None
    assert cache.evictions_total == 0  # not an eviction (idle, or making room): the metric says those

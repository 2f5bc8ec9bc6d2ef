"""Prefix affinity in routing: a call whose leading blocks a chain kept goes to that chain's shards when the prefill it
saves there outweighs what they cost beyond the cheapest chain, by predicted time of the whole call. Which chain kept
them comes from this orchestrator's own memory (hearth/services/orchestrator/prefix.py, KeptChains) and from the read
model (hearth/readmodels/kept_prefixes.py: every orchestrator's calls, through `pipeline.completed`), the longer holding
winning.

A chain's predicted time per token is what routing minimises (hearth/services/orchestrator/predict.py); a prompt token
is taken to cost `[prefix_cache] prefill_token_cost` of that (prefill runs many positions per step), so

    call_ms(chain) = time_per_token(chain) * (prefill_token_cost * positions to prefill + max_tokens)

and the kept chain wins when its call_ms, prefilling only past the blocks it holds, is the smaller. Checks come first,
as in routing (router.py rule 2): a kept chain whose hops lack more of the replicas the call's `verify` level asks
(`MirrorShortfall`) than the planned chain's is no option, since the prefill it saves would cost the call its checks
(`verification: unmet`); the call re-prefills on the planned chain instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from hearth.readmodels.queries import KeptChain, ShardCandidate
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.predict import HopCosts, MirrorShortfall
from hearth.services.orchestrator.router import Hop


def hop_ranges(hops: Iterable[Hop]) -> tuple[tuple[str, int, int], ...]:
    """A chain's hops as a kept chain records them: (shard id, first layer run, last layer run) each, in order."""
    return tuple((hop.shard_id, hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops)


def time_per_token_ms(hops: Iterable[Hop], by_id: dict[str, ShardCandidate], costs: HopCosts) -> float:
    return sum(costs.hop_ms(by_id[hop.shard_id], hop.layer_hi_to_run - hop.layer_lo_to_run + 1) for hop in hops)


def kept_hops(kept: KeptChain, usable: dict[str, ShardCandidate], quantization: str) -> list[Hop] | None:
    """The kept chain as hops, when every one of its shards may serve now (else None)."""
    hops = []
    for shard_id, layer_lo, layer_hi in kept.hops:
        shard = usable.get(shard_id)
        if shard is None or shard.quantization != quantization or not shard.layer_lo <= layer_lo <= layer_hi \
                <= shard.layer_hi:
            return None
        hops.append(Hop(shard_id=shard_id, control_subject=shard.control_subject, node_id=shard.node_id,
                        layer_lo_to_run=layer_lo, layer_hi_to_run=layer_hi, quantization=quantization))
    return hops


def lacks_more_checks(candidate: list[Hop], planned: list[Hop], usable: dict[str, ShardCandidate],
                      mirrors_per_hop: int) -> bool:
    """Whether `candidate`'s hops lack more of the replicas that would check them than `planned`'s, counted over the
    usable shards of the chains' scheme as routing counts them (router.py `plan`)."""
    if mirrors_per_hop <= 0:
        return False
    scheme = planned[0].quantization
    lacking = MirrorShortfall([c for c in usable.values() if c.quantization == scheme], mirrors_per_hop)

    def shortfall(hops: list[Hop]) -> int:
        return sum(lacking(usable[hop.shard_id], hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops)

    return shortfall(candidate) > shortfall(planned)


def prefer_kept(planned: list[Hop], kept: KeptChain | None, usable: dict[str, ShardCandidate], *,
                load: ShardLoad | None, block_tokens: int, prompt_positions: int, max_tokens: int,
                prefill_token_cost: float, mirrors_per_hop: int = 0) -> tuple[list[Hop], int]:
    """The chain to open (`planned`, the cheapest of the most checkable, or the kept one when it is as checkable) and
    the blocks it is expected to hold; `mirrors_per_hop`: the replicas the call's `verify` level has check each hop."""
    if kept is None or not planned:
        return planned, 0
    candidate = kept_hops(kept, usable, planned[0].quantization)
    if candidate is None:
        return planned, 0
    if hop_ranges(planned) == tuple(kept.hops):
        return planned, kept.blocks
    if lacks_more_checks(candidate, planned, usable, mirrors_per_hop):
        return planned, 0
    total_layers = max(hop.layer_hi_to_run for hop in planned) + 1
    costs = HopCosts(list(usable.values()), total_layers, load)
    reused = min(kept.blocks * block_tokens, max(prompt_positions - 1, 0))
    planned_ms = time_per_token_ms(planned, usable, costs) * (prefill_token_cost * prompt_positions + max_tokens)
    kept_ms = time_per_token_ms(candidate, usable, costs) * (prefill_token_cost * (prompt_positions - reused)
                                                              + max_tokens)
    return (candidate, kept.blocks) if kept_ms < planned_ms else (planned, 0)


def longer_kept(ours: KeptChain | None, recorded: KeptChain | None) -> KeptChain | None:
    """Of our own memory's kept chain and the read model's, the one holding more of the call's leading blocks (ours
    on a tie: it does not lag behind the event log)."""
    if recorded is None or (ours is not None and ours.blocks >= recorded.blocks):
        return ours
    return recorded

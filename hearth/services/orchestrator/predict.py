"""HopCosts: the predicted time a token spends on one hop, from measurements, and the cheapest chain by dynamic
programming over layer ranges (Parallax-style), for ShardRouter.

A hop running `n` layers of shard `s` costs, per token,

    (step_ms_per_layer(s) * n * (1 + streams we hold on s + its queue depth) + round_trip_ms(s)) * weight(s)

- `step_ms_per_layer`: the shard's measured decode step over its whole range (heartbeat `decode_step_ms`)
  divided by its layers;
- the queue factor: a shard's compute is shared by the streams it serves (ours are known live, the
  heartbeat's `queue_depth` tells of the rest), which is also what spreads load over replicas;
- `round_trip_ms`: the orchestrator's own measurement of the shard's control round trip (ShardLoad);
- a shard that has not reported a step time yet is predicted from the fastest measured replica of the same
  layer range (of any range when none; `default_*` when nothing is measured): it wins ties, so it is tried
  and measured before it can lose;
- `weight`: the `hop_weight` the host declared is a prior, not a claim that outweighs measurements: a weight
  below 1 ("prefer me") counts only until the shard is measured, and never below `least_prior_weight` (a shard
  that never reports a step time stays unmeasured, and a weight near 0 would win every plan), while a weight
  above 1 (a host asking to be used last: far, metered, on battery) is always honoured. An unmeasured shard is
  predicted with its peers' round trip, not its own: its first open's, taken cold, would keep a new primary from
  being tried before its replicas.

The chain minimises the sum; ties go to fewer hops, then to longer reach early (a shard's whole range), then
to unmeasured shards and shard ids, so equal plans are stable. For a call whose `verify` level asks other replicas to
check each hop (hearth/services/orchestrator/verification.py), the chain lacking the fewest of those replicas comes
before any cost (`MirrorShortfall`): a whole-model replica alone is the cheapest chain beside two half-model shards,
but nobody could check it, while each half of it can be checked by the other side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hearth.readmodels.queries import ShardCandidate
from hearth.services.orchestrator.capacity import ShardLoad

default_step_ms_per_layer = 1.0
default_round_trip_ms = 1.0
# The most an unmeasured shard's declared weight can favour it: half the cost of the same prediction.
least_prior_weight = 0.5


@dataclass(frozen=True)
class PlannedHop:
    shard: ShardCandidate
    layer_lo: int
    layer_hi: int


class HopCosts:
    """Predicted per-token cost of running layers on each candidate (one planning's worth of figures)."""

    def __init__(self, candidates: list[ShardCandidate], total_layers: int, load: ShardLoad | None) -> None:
        self.total_layers = total_layers
        self.load = load
        self._measured = [s for s in candidates if s.decode_step_ms is not None]

    def range_layers(self, shard: ShardCandidate) -> int:
        return min(shard.layer_hi, self.total_layers - 1) - shard.layer_lo + 1

    def measured(self, shard: ShardCandidate) -> bool:
        return shard.decode_step_ms is not None

    def hop_ms(self, shard: ShardCandidate, layers: int) -> float:
        held = self.load.held(shard.shard_id) if self.load is not None else 0
        queue_factor = 1 + held + (shard.queue_depth or 0)
        if self.measured(shard):
            trip = self._round_trip(shard)
            step, weight = self._step_per_layer(shard), max(1.0, shard.hop_weight)
        else:
            step, trip, weight = self._prior(shard)
        return (step * layers * queue_factor + (default_round_trip_ms if trip is None else trip)) * weight

    def _step_per_layer(self, shard: ShardCandidate) -> float:
        return shard.decode_step_ms / self.range_layers(shard)

    def _round_trip(self, shard: ShardCandidate) -> float | None:
        return self.load.round_trip_ms(shard.shard_id) if self.load is not None else None

    def _prior(self, shard: ShardCandidate) -> tuple[float, float | None, float]:
        """(step ms per layer, round trip ms, weight) assumed for a shard that has not reported a step time."""
        replicas = [s for s in self._measured if (s.layer_lo, s.layer_hi) == (shard.layer_lo, shard.layer_hi)]
        peers = replicas or self._measured
        weight = max(least_prior_weight, shard.hop_weight)
        if not peers:
            return default_step_ms_per_layer, None, weight
        trips = [trip for s in peers if (trip := self._round_trip(s)) is not None]
        return min(self._step_per_layer(s) for s in peers), min(trips, default=None), weight


class MirrorShortfall:
    """How many of the other replicas a hop's checks ask for (`mirrors_per_hop`, by the call's `verify` level) it
    would lack among `candidates`: those on other nodes (one per node: a host cannot vouch for itself, nor one mirror's
    host twice) whose range covers the layers the hop runs, as a mirror is chosen (mirror.py `open_mirror`)."""

    def __init__(self, candidates: list[ShardCandidate], mirrors_per_hop: int) -> None:
        self.candidates = candidates
        self.mirrors_per_hop = mirrors_per_hop

    def __call__(self, shard: ShardCandidate, layer_lo: int, layer_hi: int) -> int:
        if self.mirrors_per_hop <= 0:
            return 0
        nodes = {c.node_id for c in self.candidates
                 if c.node_id != shard.node_id and c.layer_lo <= layer_lo and layer_hi <= c.layer_hi}
        return max(0, self.mirrors_per_hop - len(nodes))


def cheapest_chain(candidates: list[ShardCandidate], costs: HopCosts,
                   may_be_hop_zero: Callable[[ShardCandidate], bool],
                   shortfall: MirrorShortfall | None = None) -> list[PlannedHop] | None:
    """The chain covering layers 0..total-1 with the least predicted time per token, or None when none does; with
    `shortfall`, the one whose hops lack the fewest replicas to check them first, then the least time.

    Positions a chain can reach are 0 and every shard's layer_lo and layer_hi + 1, so a hop ends at its
    shard's last layer or just before another shard's range begins: O(shards^3) work at most.
    """
    total = costs.total_layers
    cuts = sorted({0, total} | {s.layer_lo for s in candidates if s.layer_lo < total}
                  | {min(s.layer_hi, total - 1) + 1 for s in candidates})
    # position -> (ordering key, chain reaching it)
    best: dict[int, tuple[tuple, list[PlannedHop]]] = {0: ((0, 0.0, 0, (), ()), [])}
    for cursor in cuts:
        if cursor not in best or cursor >= total:
            continue
        (lacking, cost, hops, ends, names), chain = best[cursor]
        for shard in candidates:
            if not shard.layer_lo <= cursor <= shard.layer_hi or (cursor == 0 and not may_be_hop_zero(shard)):
                continue
            if any(hop.shard is shard for hop in chain):
                continue  # a shard holds one hop of a pipeline (checks alone would split one in two, each checked)
            reach = min(shard.layer_hi, total - 1)
            for end in [cut - 1 for cut in cuts if cursor < cut <= reach + 1]:
                key = (lacking + (shortfall(shard, cursor, end) if shortfall is not None else 0),
                       round(cost + costs.hop_ms(shard, end - cursor + 1), 6), hops + 1, ends + (-end,),
                       names + ((costs.measured(shard), shard.shard_id),))
                if end + 1 not in best or key < best[end + 1][0]:
                    best[end + 1] = (key, chain + [PlannedHop(shard, cursor, end)])
    if total not in best:
        # A chain that skipped a shard already on it may have cut off the only way on: the cheapest chain, unchecked.
        return cheapest_chain(candidates, costs, may_be_hop_zero) if shortfall is not None else None
    return best[total][1]

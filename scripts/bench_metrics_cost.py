"""Times what metrics add to one decode token of a pipeline of `--hops` shards: every shard's step observation
(five histograms) and the orchestrator's per-hop latency (one histogram per hop), with metrics on and off.

Everything else is counted once per call or read at scrape time, so this is the whole per-token cost:

    .venv/bin/python scripts/bench_metrics_cost.py --hops 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from hearth.services.common.metrics import set_metrics_observed
from hearth.services.orchestrator.metrics import HopLatencies
from hearth.services.shard.metrics import ShardStepMetrics


def per_call_us(function, calls: int, rounds: int) -> float:
    """Median over `rounds` of the mean time of one call, in microseconds."""
    means = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        means.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hops", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shard_ids = [f"bench:{i}-{i}@host{i}" for i in range(args.hops)]
    shards = [ShardStepMetrics(shard_id) for shard_id in shard_ids]
    latencies = HopLatencies(shard_ids)
    first_acks = {hop: 1.0 + hop * 0.01 for hop in range(args.hops)}

    def one_token() -> None:
        for shard in shards:
            shard.observe("decode", wire_s=0.0002, deserialize_s=0.0001, serialize_s=0.0001, compute_s=0.02)
        latencies.observe(first_acks, 1.0 + args.hops * 0.01)

    for observed in (True, False):
        set_metrics_observed(observed)
        cost = per_call_us(one_token, args.calls, args.rounds)
        print(f"metrics {'on ' if observed else 'off'}: {cost:6.2f} us per decode token ({args.hops} hops)")


if __name__ == "__main__":
    main()

"""Where a decode token's time goes in the bench's single-session pipeline runs: the hops' layers and transport (the
shards' step histograms, transport_metrics.py) and the orchestrator's turn with its head step inside (its
`hearth_orchestrator_turn_seconds` and `hearth_head_step_seconds`, scraped from /metrics before and after)."""

from __future__ import annotations

from hearth.services.devtools.bench.report import TokenBudget, TransportFigures
from hearth.services.devtools.bench.transport_metrics import Histogram
from hearth.services.orchestrator.metrics import HEAD_STEP_METRIC, ORCHESTRATOR_TURN_METRIC

ORCHESTRATOR_TIMINGS = (ORCHESTRATOR_TURN_METRIC, HEAD_STEP_METRIC)


def parse_orchestrator_timings(text: str) -> dict[str, Histogram]:
    """The histograms of ORCHESTRATOR_TIMINGS in one /metrics exposition (those it does not show left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, _, part = sample.name.rpartition("_")
            if name not in ORCHESTRATOR_TIMINGS:
                continue
            if part == "bucket":
                buckets.setdefault(name, []).append((float(sample.labels["le"]), sample.value))
            elif part == "sum":
                sums[name] = sample.value
    return {name: Histogram([bound for bound, _ in sorted(rows)], [count for _, count in sorted(rows)],
                            sums.get(name, 0.0))
            for name, rows in buckets.items()}


def token_budget(decode_tokens_per_s: float, transport_decode: list[TransportFigures],
                 after: dict[str, Histogram] | None, before: dict[str, Histogram] | None) -> TokenBudget:
    """The split of a decode token's time from the runs' median speed, their per-hop decode figures and two scrapes
    of the orchestrator's timings around them."""
    hops = [row for row in transport_decode if row.hop is not None]
    compute = _hop_sum([row.compute_mean_ms for row in hops])
    transport = _hop_sum([row.mean_ms for row in hops])
    turn, head = (None if after is None or before is None or name not in after
                  else after[name].minus(before.get(name)).mean_ms for name in ORCHESTRATOR_TIMINGS)
    token_ms = 1000.0 / decode_tokens_per_s
    accounted = (compute, transport, turn)
    other = None if None in accounted else token_ms - sum(accounted)
    return TokenBudget(token_ms=token_ms, hops_compute_ms=compute, hops_transport_ms=transport,
                       orchestrator_turn_ms=turn, head_step_ms=head, other_ms=other)


def _hop_sum(values: list[float | None]) -> float | None:
    return None if not values or None in values else sum(values)


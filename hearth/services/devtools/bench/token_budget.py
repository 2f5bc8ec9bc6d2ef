"""Where a decode token's time goes in the bench's single-session pipeline runs: the hops' layers and transport (the
shards' step histograms, transport_metrics.py) and the orchestrator's turn with its head step inside (its
`hearth_orchestrator_turn_seconds` and `hearth_head_step_seconds`, scraped from /metrics before and after)."""

from __future__ import annotations

import urllib.request

from hearth.services.devtools.bench.report import TokenBudget, TransportFigures
from hearth.services.devtools.bench.transport_metrics import metrics_scrape_timeout_s
from hearth.services.orchestrator.metrics import HEAD_STEP_METRIC, ORCHESTRATOR_TURN_METRIC

ORCHESTRATOR_TIMINGS = (ORCHESTRATOR_TURN_METRIC, HEAD_STEP_METRIC)


def parse_orchestrator_timings(text: str) -> dict[str, tuple[float, float]]:
    """Per histogram of ORCHESTRATOR_TIMINGS: (sum of seconds, count) in one /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in ORCHESTRATOR_TIMINGS:
                if sample.name == f"{name}_sum":
                    sums[name] = sample.value
                elif sample.name == f"{name}_count":
                    counts[name] = sample.value
    return {name: (sums[name], counts[name]) for name in ORCHESTRATOR_TIMINGS if name in sums and name in counts}


def scrape_orchestrator_timings(url: str) -> dict[str, tuple[float, float]]:
    """The orchestrator's turn and head-step histograms now (blocking: call it off the event loop)."""
    with urllib.request.urlopen(url, timeout=metrics_scrape_timeout_s) as response:
        return parse_orchestrator_timings(response.read().decode())


def token_budget(decode_tokens_per_s: float, transport_decode: list[TransportFigures],
                 after: dict[str, tuple[float, float]] | None,
                 before: dict[str, tuple[float, float]] | None) -> TokenBudget:
    """The split of a decode token's time from the runs' median speed, their per-hop decode figures and two scrapes
    of the orchestrator's timings around them."""
    hops = [row for row in transport_decode if row.hop is not None]
    compute = _hop_sum([row.compute_mean_ms for row in hops])
    transport = _hop_sum([row.mean_ms for row in hops])
    turn, head = (_mean_ms_between(after, before, name) for name in ORCHESTRATOR_TIMINGS)
    token_ms = 1000.0 / decode_tokens_per_s
    accounted = (compute, transport, turn)
    other = None if None in accounted else token_ms - sum(accounted)
    return TokenBudget(token_ms=token_ms, hops_compute_ms=compute, hops_transport_ms=transport,
                       orchestrator_turn_ms=turn, head_step_ms=head, other_ms=other)


def _hop_sum(values: list[float | None]) -> float | None:
    return None if not values or None in values else sum(values)


def _mean_ms_between(after: dict[str, tuple[float, float]] | None, before: dict[str, tuple[float, float]] | None,
                     name: str) -> float | None:
    if after is None or before is None or name not in after:
        return None
    total_s, count = after[name]
    earlier_s, earlier_count = before.get(name, (0.0, 0.0))
    observed = count - earlier_count
    return (total_s - earlier_s) / observed * 1000.0 if observed > 0 else None

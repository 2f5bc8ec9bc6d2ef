"""Per-hop transport overhead: the shard hosts' step histograms scraped from Prometheus, turned into p50/p95 figures
(and their continuous-batching counters, turned into mean batch sizes).

Each shard host observes, for every step, its inbound wire time, deserialisation and serialisation
(hearth/services/shard/metrics.py); the bench scrapes the histograms before and after a measurement and
reports quantiles of the difference (linear interpolation inside buckets, like PromQL).
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
from dataclasses import dataclass, field

from hearth.services.devtools.bench.report import TransportFigures
from hearth.services.shard.metrics import (
    BATCH_ROWS_FAMILY,
    BATCHES_FAMILY,
    GRAPH_CAPTURES_FAMILY,
    KV_EVICTIONS_FAMILY,
    PREFILL_BATCH_ROWS_FAMILY,
    PREFILL_BATCHES_FAMILY,
    COMPUTE_METRIC,
    DESERIALIZE_METRIC,
    SERIALIZE_METRIC,
    TRANSPORT_METRIC,
    WIRE_METRIC,
)

metrics_scrape_timeout_s = 5.0


@dataclass
class Histogram:
    """Cumulative bucket counts of one labelled histogram (upper bounds ascending, +Inf last)."""

    bounds_s: list[float]
    cumulative: list[float]
    sum_s: float = 0.0

    def minus(self, earlier: "Histogram | None") -> "Histogram":
        if earlier is None:
            return self
        return Histogram(self.bounds_s, [a - b for a, b in zip(self.cumulative, earlier.cumulative)],
                         self.sum_s - earlier.sum_s)

    def plus(self, other: "Histogram") -> "Histogram":
        return Histogram(self.bounds_s, [a + b for a, b in zip(self.cumulative, other.cumulative)],
                         self.sum_s + other.sum_s)

    @property
    def mean_ms(self) -> float | None:
        return self.sum_s / self.count * 1000.0 if self.count else None

    @property
    def count(self) -> int:
        return int(self.cumulative[-1]) if self.cumulative else 0

    def quantile_ms(self, fraction: float) -> float | None:
        """Like PromQL histogram_quantile: linear inside the bucket holding the rank."""
        total = self.count
        if total == 0:
            return None
        rank = fraction * total
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in zip(self.bounds_s, self.cumulative):
            if count >= rank:
                if math.isinf(bound):
                    return previous_bound * 1000.0
                width = count - previous_count
                inside = (rank - previous_count) / width if width else 1.0
                return (previous_bound + (bound - previous_bound) * inside) * 1000.0
            previous_bound, previous_count = bound, count
        return previous_bound * 1000.0

    def share_at_most(self, bound_s: float) -> float | None:
        """Exact share of observations <= bound_s (bound_s must be a bucket bound)."""
        if self.count == 0:
            return None
        for bound, count in zip(self.bounds_s, self.cumulative):
            if math.isclose(bound, bound_s):
                return count / self.count
        raise ValueError(f"{bound_s} is not a bucket bound")


MetricKey = tuple[str, str, str]  # (metric, shard_id, kind)


@dataclass
class HostScrape:
    """What the shard hosts' /metrics said at one moment: their step histograms and, per shard id, their batching
    counters (batched decode steps run, session rows in them; the same for batched prefills)."""

    histograms: dict[MetricKey, Histogram]
    batching: dict[str, tuple[float, float]]
    prefill_batching: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Per shard id: (KV-cache evictions, CUDA graphs captured) since the shard started.
    cache_events: dict[str, tuple[float, float]] = field(default_factory=dict)


def fetch_metrics_text(url: str) -> str:
    """One process's /metrics exposition (blocking: call it off the event loop)."""
    with urllib.request.urlopen(url, timeout=metrics_scrape_timeout_s) as response:
        return response.read().decode()


def scrape_host(url: str) -> HostScrape:
    """One shard host's /metrics: its step histograms and batching counters, from one request."""
    from prometheus_client.parser import text_string_to_metric_families

    text = fetch_metrics_text(url)
    rows: dict[MetricKey, list[tuple[float, float]]] = {}
    sums: dict[MetricKey, float] = {}
    counted: dict[str, dict[str, list[float]]] = {"decode": {}, "prefill": {}, "cache": {}}
    counters = {f"{BATCHES_FAMILY}_total": ("decode", 0), f"{BATCH_ROWS_FAMILY}_total": ("decode", 1),
                f"{PREFILL_BATCHES_FAMILY}_total": ("prefill", 0), f"{PREFILL_BATCH_ROWS_FAMILY}_total": ("prefill", 1),
                f"{KV_EVICTIONS_FAMILY}_total": ("cache", 0), f"{GRAPH_CAPTURES_FAMILY}_total": ("cache", 1)}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counters:
                kind, column = counters[sample.name]
                counted[kind].setdefault(sample.labels["shard_id"], [0.0, 0.0])[column] = sample.value
            if not sample.name.startswith("hearth_shard_step_"):
                continue
            if sample.name.endswith("_bucket"):
                key = (sample.name.removesuffix("_bucket"), sample.labels["shard_id"], sample.labels["kind"])
                rows.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                key = (sample.name.removesuffix("_sum"), sample.labels["shard_id"], sample.labels["kind"])
                sums[key] = sample.value
    histograms = {}
    for key, buckets in rows.items():
        buckets.sort()
        histograms[key] = Histogram([b for b, _ in buckets], [c for _, c in buckets], sums.get(key, 0.0))
    decode, prefill, cache = ({shard: (first, second) for shard, (first, second) in counted[kind].items()}
                              for kind in ("decode", "prefill", "cache"))
    return HostScrape(histograms, batching=decode, prefill_batching=prefill, cache_events=cache)


def mean_batch_rows(after: dict[str, tuple[float, float]],
                    before: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Per shard id: session rows per batched step between two scrapes (shards that batched nothing left
    out)."""
    means = {}
    for shard_id, (batches, rows) in after.items():
        earlier_batches, earlier_rows = before.get(shard_id, (0.0, 0.0))
        if batches > earlier_batches:
            means[shard_id] = (rows - earlier_rows) / (batches - earlier_batches)
    return means


async def scrape_hosts(metrics_urls: dict[str, str]) -> HostScrape:
    """Every shard host's /metrics, one request each, merged (each host labels its own figures by shard_id)."""
    merged = HostScrape({}, {})
    for url in metrics_urls.values():
        host = await asyncio.to_thread(scrape_host, url)
        merged.histograms.update(host.histograms)
        merged.batching.update(host.batching)
        merged.prefill_batching.update(host.prefill_batching)
        merged.cache_events.update(host.cache_events)
    return merged


def cache_event_counts(after: dict[str, tuple[float, float]],
                       before: dict[str, tuple[float, float]]) -> dict[str, dict[str, int]]:
    """Per shard id: KV evictions and CUDA graph captures between two scrapes (shards with neither left out)."""
    counts = {}
    for shard_id, (evictions, captures) in after.items():
        earlier_evictions, earlier_captures = before.get(shard_id, (0.0, 0.0))
        if evictions > earlier_evictions or captures > earlier_captures:
            counts[shard_id] = {"kv_evictions": int(evictions - earlier_evictions),
                                "graph_captures": int(captures - earlier_captures)}
    return counts


def histogram_deltas(after: dict[MetricKey, Histogram],
                     before: dict[MetricKey, Histogram]) -> dict[MetricKey, Histogram]:
    """What was observed between two scrapes."""
    return {key: histogram.minus(before.get(key)) for key, histogram in after.items()}


def transport_figures(delta: dict[MetricKey, Histogram], kind: str, hop_of: dict[str, int]) -> list[TransportFigures]:
    """Per shard, then pooled over all hops (shard_id "all")."""
    def pick(metric: str, shard_id: str | None) -> Histogram | None:
        chosen = [h for (m, s, k), h in delta.items() if m == metric and k == kind and shard_id in (None, s)]
        if not chosen:
            return None
        total = chosen[0]
        for histogram in chosen[1:]:
            total = total.plus(histogram)
        return total

    def _mean(histogram: Histogram | None) -> float | None:
        return histogram.mean_ms if histogram is not None else None

    def q(histogram: Histogram | None, fraction: float) -> float | None:
        return histogram.quantile_ms(fraction) if histogram is not None else None

    rows = []
    for shard_id in [*sorted(hop_of, key=hop_of.get), None]:
        overall = pick(TRANSPORT_METRIC, shard_id)
        if overall is None or overall.count == 0:
            continue
        wire = pick(WIRE_METRIC, shard_id)
        rows.append(TransportFigures(
            hop=hop_of.get(shard_id) if shard_id else None, shard_id=shard_id or "all", steps=overall.count,
            p50_ms=q(overall, 0.5), p95_ms=q(overall, 0.95), share_at_most_1ms=overall.share_at_most(0.001),
            wire_p50_ms=q(wire, 0.5), wire_p95_ms=q(wire, 0.95),
            deserialize_p95_ms=q(pick(DESERIALIZE_METRIC, shard_id), 0.95),
            serialize_p95_ms=q(pick(SERIALIZE_METRIC, shard_id), 0.95),
            mean_ms=overall.mean_ms, compute_mean_ms=_mean(pick(COMPUTE_METRIC, shard_id)),
        ))
    return rows

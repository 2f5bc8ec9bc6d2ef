"""Prometheus histograms of a shard host's steps: transport overhead (wire, deserialise, serialise) and compute.

A shard host observes every step it serves; `hearth shard --metrics-port P` serves them on
http://127.0.0.1:P/metrics (`hearth bench` scrapes them to report the per-hop transport overhead).
All durations are in seconds, labelled with the shard id and the step kind (`prefill` / `decode`):

* ``hearth_shard_step_wire_seconds``: the step's inbound leg, from the upstream node publishing its
  first chunk to this host holding its last chunk (both ends read the same wall clock on one machine;
  across machines it includes their clock offset);
* ``hearth_shard_step_deserialize_seconds``: header parsing, reassembly and dtype restore of the step;
* ``hearth_shard_step_serialize_seconds``: turning this host's output into wire bytes;
* ``hearth_shard_step_transport_seconds``: the sum of those three for the same step — what one hop
  adds to a token's latency besides its layers; per step, so its percentiles are exact up to buckets;
* ``hearth_shard_step_compute_seconds``: running the step's layers (worker thread included).

Buckets are 0.1 ms apart up to 1 ms so a percentile near the 1 ms target is read to within 0.1 ms.

What a shard serves is read at scrape time from its ShardCompute (ShardServingCollector), costing nothing per step:
``hearth_shard_active_sessions`` (hops open), ``hearth_shard_kv_cache_bytes`` and
``hearth_shard_tokens_served_total`` (the reputation signal its heartbeats carry), and the continuous batching
counters ``hearth_shard_decode_batches_total`` / ``hearth_shard_decode_batch_rows_total`` and
``hearth_shard_prefill_batches_total`` / ``hearth_shard_prefill_batch_rows_total``, and what a cache costs:
``hearth_shard_kv_evictions_total`` (sessions evicted, idle or over the KV budget: each is re-prefilled) and
``hearth_shard_cuda_graph_captures_total`` (on a GPU: a graph per session, per new set of sessions decoding
together, and again as they cross an attention width),
and what kept prefixes save (hearth/inference/prefix_cache.py):
``hearth_shard_prefix_lookups_total{outcome="hit"|"miss"}`` (hops opened naming blocks, that found some kept / none),
``hearth_shard_prefix_evictions_total`` (kept prefixes dropped, idle or making room),
``hearth_shard_prefix_reused_tokens_total`` (positions taken from them instead of computed) and
``hearth_shard_prefill_tokens_total`` (prompt positions computed), all labelled by shard id.
"""

from __future__ import annotations

import statistics
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hearth.events.models import ShardHeartbeat
from hearth.services.common.metrics import histogram, metrics_observed
from hearth.services.common.percentiles import nearest_rank

transport_buckets_s = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008, 0.0009, 0.001,
    0.00125, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
compute_buckets_s = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0,
)
STEP_LABELS = ("shard_id", "kind")

WIRE_METRIC = "hearth_shard_step_wire_seconds"
DESERIALIZE_METRIC = "hearth_shard_step_deserialize_seconds"
SERIALIZE_METRIC = "hearth_shard_step_serialize_seconds"
TRANSPORT_METRIC = "hearth_shard_step_transport_seconds"
COMPUTE_METRIC = "hearth_shard_step_compute_seconds"
# Counter families (their samples carry a `_total` suffix).
BATCHES_FAMILY = "hearth_shard_decode_batches"
BATCH_ROWS_FAMILY = "hearth_shard_decode_batch_rows"
PREFILL_BATCHES_FAMILY = "hearth_shard_prefill_batches"
PREFILL_BATCH_ROWS_FAMILY = "hearth_shard_prefill_batch_rows"
KV_EVICTIONS_FAMILY = "hearth_shard_kv_evictions"
GRAPH_CAPTURES_FAMILY = "hearth_shard_cuda_graph_captures"
PREFIX_LOOKUPS_FAMILY = "hearth_shard_prefix_lookups"
PREFIX_EVICTIONS_FAMILY = "hearth_shard_prefix_evictions"
PREFIX_REUSED_FAMILY = "hearth_shard_prefix_reused_tokens"
PREFILL_TOKENS_FAMILY = "hearth_shard_prefill_tokens"

latency_samples_kept = 256


@dataclass
class ServingStats:
    """What a shard's ShardCompute counts of its work (its heartbeats and metrics read it)."""

    tokens_served_total: int = 0
    # Prompt positions this shard computed (a kept prefix's positions are not computed again).
    prefill_tokens_total: int = 0
    steps_in_compute: int = 0
    step_latencies_s: deque = field(default_factory=lambda: deque(maxlen=latency_samples_kept))
    # Decode steps only, each scaled to the shard's whole range (a hop may run part of it).
    decode_step_s: deque = field(default_factory=lambda: deque(maxlen=latency_samples_kept))

    def decode_step_ms(self) -> float | None:
        """The median decode step over the whole range, in ms; None before the first decode step."""
        return 1000.0 * statistics.median(self.decode_step_s) if self.decode_step_s else None

    def p95_latency_ms(self) -> float:
        """Nearest-rank p95 of the kept steps in ms, as every p95 hearth reports (0.0 before the first step)."""
        p95 = nearest_rank(sorted(self.step_latencies_s), 0.95)
        return 0.0 if p95 is None else 1000.0 * p95

    def heartbeat(self, node_id: str, shard_id: str, *, queue_depth: int = 0,
                  active_streams: int = 0) -> ShardHeartbeat:
        """The shard's heartbeat with these figures (queue and streams as its server counts them; none when it
        serves nothing)."""
        return ShardHeartbeat(node_id=node_id, shard_id=shard_id, queue_depth=queue_depth,
                              active_streams=active_streams, p95_latency_ms=self.p95_latency_ms(),
                              tokens_served_total=self.tokens_served_total, decode_step_ms=self.decode_step_ms())


class ShardStepMetrics:
    """Observes one shard's steps; `observe` costs a few microseconds, so it runs for every step."""

    def __init__(self, shard_id: str, *, registry: CollectorRegistry = REGISTRY) -> None:
        self.shard_id = shard_id
        self._wire = histogram(WIRE_METRIC, "Inbound leg of a step: first chunk published upstream -> last "
                               "chunk received here.", STEP_LABELS, buckets=transport_buckets_s, registry=registry)
        self._deserialize = histogram(DESERIALIZE_METRIC, "Header parsing, reassembly and dtype restore of a "
                                      "received step.", STEP_LABELS, buckets=transport_buckets_s, registry=registry)
        self._serialize = histogram(SERIALIZE_METRIC, "Encoding this host's output of a step into wire bytes.",
                                    STEP_LABELS, buckets=transport_buckets_s, registry=registry)
        self._transport = histogram(TRANSPORT_METRIC, "wire + deserialize + serialize of one step at this hop: "
                                    "its transport overhead, layer compute excluded.", STEP_LABELS,
                                    buckets=transport_buckets_s, registry=registry)
        self._compute = histogram(COMPUTE_METRIC, "Running a step's layers on this host.", STEP_LABELS,
                                  buckets=compute_buckets_s, registry=registry)
        self._children: dict[str, tuple] = {}

    def observe(self, kind: str, *, wire_s: float | None, deserialize_s: float, serialize_s: float,
                compute_s: float) -> None:
        if not metrics_observed():
            return
        children = self._children.get(kind)
        if children is None:  # labels() costs as much as an observation: looked up once per kind
            children = self._children[kind] = tuple(
                metric.labels(self.shard_id, kind)
                for metric in (self._deserialize, self._serialize, self._compute, self._wire, self._transport))
        deserialize, serialize, compute, wire, transport = children
        deserialize.observe(deserialize_s)
        serialize.observe(serialize_s)
        compute.observe(compute_s)
        if wire_s is not None:  # a sender that stamps no send time (older peer): nothing to add up
            wire.observe(wire_s)
            transport.observe(wire_s + deserialize_s + serialize_s)


class ServingFigures(Protocol):
    """What ShardServingCollector reads off a shard (hearth/services/shard/compute.py's ShardCompute)."""

    shard_id: str

    def serving_figures(self) -> tuple[int, int, int]:
        """(hops open, KV-cache bytes, tokens served since start)."""

    def batching_figures(self) -> tuple[int, int]:
        """(batched decode steps run, session rows in them) since start."""

    def prefill_batching_figures(self) -> tuple[int, int]:
        """(batched prefill steps run, session rows in them) since start."""

    def cache_event_figures(self) -> tuple[int, int]:
        """(KV-cache evictions, CUDA graphs captured) since start."""

    def prefix_figures(self) -> tuple[int, int, int, int, int]:
        """(prefix hits, misses, evictions, positions reused, prompt positions computed) since start."""


class ShardServingCollector(Collector):
    """Reads every live shard of this process (usually one) at scrape time."""

    def __init__(self) -> None:
        self._shards: weakref.WeakSet = weakref.WeakSet()

    def watch(self, shard: ServingFigures) -> None:
        self._shards.add(shard)

    def collect(self) -> Iterator[Metric]:
        labels = ["shard_id"]
        sessions = GaugeMetricFamily("hearth_shard_active_sessions", "Pipeline hops (sessions) this shard serves now.",
                                     labels=labels)
        cache = GaugeMetricFamily("hearth_shard_kv_cache_bytes", "Bytes of KV cache this shard holds for its sessions.",
                                  labels=labels)
        tokens = CounterMetricFamily("hearth_shard_tokens_served", "Token positions run through this shard's layers "
                                     "(prefill and decode): the reputation signal of its heartbeats.", labels=labels)
        batches = CounterMetricFamily(BATCHES_FAMILY, "Decode steps run as one batch for the ready "
                                      "steps of several sessions (continuous batching).", labels=labels)
        rows = CounterMetricFamily(BATCH_ROWS_FAMILY, "Session decode steps run in those batches "
                                   "(rows / batches: the mean batch size).", labels=labels)
        prefill_batches = CounterMetricFamily(PREFILL_BATCHES_FAMILY, "Prefill steps run as one batch for the "
                                              "short prompts (or last chunks) of several sessions.", labels=labels)
        prefill_rows = CounterMetricFamily(PREFILL_BATCH_ROWS_FAMILY, "Session prefill steps run in those batches "
                                           "(rows / batches: the mean batch size).", labels=labels)
        evictions = CounterMetricFamily(KV_EVICTIONS_FAMILY, "Sessions whose KV cache this shard evicted (idle, or "
                                        "over its KV budget); each one's next step is re-prefilled.", labels=labels)
        captures = CounterMetricFamily(GRAPH_CAPTURES_FAMILY, "CUDA graphs this shard captured (a session's decode "
                                       "step, or a new set of sessions decoding together, again at each attention "
                                       "width they reach); 0 without graphs.",
                                       labels=labels)
        lookups = CounterMetricFamily(PREFIX_LOOKUPS_FAMILY, "Hops opened naming blocks of a kept prefix: `hit` when "
                                      "some were kept here, `miss` when none.", labels=[*labels, "outcome"])
        prefix_evictions = CounterMetricFamily(PREFIX_EVICTIONS_FAMILY, "Kept prefixes dropped (unused for "
                                               "prefix_cache_idle_s, or making room for live sessions).",
                                               labels=labels)
        reused = CounterMetricFamily(PREFIX_REUSED_FAMILY, "Session positions taken from kept prefixes instead of "
                                     "computed.", labels=labels)
        prefilled = CounterMetricFamily(PREFILL_TOKENS_FAMILY, "Prompt positions this shard computed.", labels=labels)
        for shard in list(self._shards):
            open_hops, cache_bytes, served = shard.serving_figures()
            sessions.add_metric([shard.shard_id], open_hops)
            cache.add_metric([shard.shard_id], cache_bytes)
            tokens.add_metric([shard.shard_id], served)
            batch_count, row_count = shard.batching_figures() if hasattr(shard, "batching_figures") else (0, 0)
            batches.add_metric([shard.shard_id], batch_count)
            rows.add_metric([shard.shard_id], row_count)
            batch_count, row_count = (shard.prefill_batching_figures() if hasattr(shard, "prefill_batching_figures")
                                      else (0, 0))
            prefill_batches.add_metric([shard.shard_id], batch_count)
            prefill_rows.add_metric([shard.shard_id], row_count)
            evicted, captured = shard.cache_event_figures() if hasattr(shard, "cache_event_figures") else (0, 0)
            evictions.add_metric([shard.shard_id], evicted)
            captures.add_metric([shard.shard_id], captured)
            hits, misses, dropped, reused_tokens, prefill_tokens = (
                shard.prefix_figures() if hasattr(shard, "prefix_figures") else (0, 0, 0, 0, 0))
            lookups.add_metric([shard.shard_id, "hit"], hits)
            lookups.add_metric([shard.shard_id, "miss"], misses)
            prefix_evictions.add_metric([shard.shard_id], dropped)
            reused.add_metric([shard.shard_id], reused_tokens)
            prefilled.add_metric([shard.shard_id], prefill_tokens)
        yield from (sessions, cache, tokens, batches, rows, prefill_batches, prefill_rows, evictions, captures,
                    lookups, prefix_evictions, reused, prefilled)


# Weakly keyed by the registry itself, not its id: a later registry may reuse a freed one's id.
_serving_collectors: weakref.WeakKeyDictionary[CollectorRegistry, ShardServingCollector] = weakref.WeakKeyDictionary()
_serving_lock = threading.Lock()


def watch_serving(shard: ServingFigures, *, registry: CollectorRegistry = REGISTRY) -> None:
    """Expose `shard`'s serving figures on `registry` for as long as the shard lives."""
    with _serving_lock:
        collector = _serving_collectors.get(registry)
        if collector is None:
            collector = _serving_collectors[registry] = ShardServingCollector()
            registry.register(collector)
    collector.watch(shard)

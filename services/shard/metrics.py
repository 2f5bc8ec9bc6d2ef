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
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from services.common.metrics import histogram

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

    def observe(self, kind: str, *, wire_s: float | None, deserialize_s: float, serialize_s: float,
                compute_s: float) -> None:
        labels = (self.shard_id, kind)
        self._deserialize.labels(*labels).observe(deserialize_s)
        self._serialize.labels(*labels).observe(serialize_s)
        self._compute.labels(*labels).observe(compute_s)
        if wire_s is not None:  # a sender that stamps no send time (older peer): nothing to add up
            self._wire.labels(*labels).observe(wire_s)
            self._transport.labels(*labels).observe(wire_s + deserialize_s + serialize_s)

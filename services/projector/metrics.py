"""Prometheus view of a running Projector: applied events, positions, lag per stream, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from readmodels.runner import Projector


class ProjectorCollector(Collector):
    """Exposes the projector's own counters, so nothing has to be kept in sync with them."""

    def __init__(self, projector: Projector) -> None:
        self._projector = projector

    def collect(self) -> Iterator[Metric]:
        projector = self._projector
        name = projector.projection.name
        labels = ["projection", "stream"]
        applied = CounterMetricFamily(
            "hearth_projector_applied_events",
            "Stream messages applied to the read model (undecodable ones only move the position).",
            labels=labels,
        )
        skipped = CounterMetricFamily(
            "hearth_projector_skipped_events", "Undecodable stream messages stepped over.", labels=labels
        )
        position = GaugeMetricFamily(
            "hearth_projector_position", "Last stream sequence committed to the read model.", labels=labels
        )
        last_seq = GaugeMetricFamily(
            "hearth_projector_stream_last_seq", "Last sequence stored in the stream (polled).", labels=labels
        )
        lag = GaugeMetricFamily(
            "hearth_projector_lag_events", "Stream last sequence minus the applied position.", labels=labels
        )
        for stream in projector.streams:
            values = [name, stream]
            applied.add_metric(values, projector.applied_total[stream])
            skipped.add_metric(values, projector.skipped_total[stream])
            position.add_metric(values, projector.positions[stream])
            last_seq.add_metric(values, projector.stream_last_seqs[stream])
            lag.add_metric(values, projector.lag(stream))
        batches = CounterMetricFamily(
            "hearth_projector_batches", "Transactions committed by the projector.", labels=["projection"]
        )
        batches.add_metric([name], projector.batches_total)
        failures = CounterMetricFamily(
            "hearth_projector_apply_failures",
            "Batches whose transaction failed (the projector resumed from the stored positions).",
            labels=["projection"],
        )
        failures.add_metric([name], projector.apply_failures_total)
        yield from (applied, skipped, position, last_seq, lag, batches, failures)

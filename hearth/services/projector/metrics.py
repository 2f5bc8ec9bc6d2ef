"""Prometheus view of a running Projector: applied events, positions, lag per stream, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hearth.events.models import EVENT_TYPES
from hearth.readmodels.runner import Projector


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
        replaced = GaugeMetricFamily(
            "hearth_projector_stream_replaced",
            "1 when the stream was deleted and created again after this read model's position was taken in it: "
            "the read model no longer follows the log until it is rebuilt.", labels=labels,
        )
        lag_seconds = GaugeMetricFamily(
            "hearth_projector_lag_seconds",
            "Age of the oldest message read from the stream and not applied yet (0: everything read is applied).",
            labels=labels,
        )
        for stream in projector.streams:
            values = [name, stream]
            applied.add_metric(values, projector.applied_total[stream])
            skipped.add_metric(values, projector.skipped_total[stream])
            position.add_metric(values, projector.positions[stream])
            last_seq.add_metric(values, projector.stream_last_seqs[stream])
            lag.add_metric(values, projector.lag(stream))
            lag_seconds.add_metric(values, projector.lag_seconds(stream))
            replaced.add_metric(values, 1 if stream in projector.replaced_streams else 0)
        by_type = CounterMetricFamily(
            "hearth_projector_events_applied",
            "Events applied to the read model, by event type (rejected and undecodable ones are not).",
            labels=["event_type"],
        )
        # Every known type from the start, so a rate over one that has not happened yet reads 0, not nothing.
        applied_by_type = {**dict.fromkeys(EVENT_TYPES, 0), **projector.applied_by_type}
        for event_type, count in sorted(applied_by_type.items()):
            by_type.add_metric([event_type], count)
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
        pruned = CounterMetricFamily(
            "hearth_projector_pruned_rows",
            "History rows deleted as they aged past the [readmodels] retention.",
            labels=["projection"],
        )
        pruned.add_metric([name], projector.pruned_total)
        yield from (applied, by_type, skipped, position, last_seq, lag, lag_seconds, replaced, batches, failures,
                    pruned)

"""The metrics the orchestrator and the shards derive (hearth/services/orchestrator/metrics.py,
hearth/services/shard/metrics.py), the `--metrics-port` switch and LocalCluster's reading of it."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry

from hearth.events.models import (
    IntegrityCorruptionDetected, PipelineFailover, PipelineFallbackLocal, PipelineFirstToken,
)
from hearth.services.devtools.bench.transport_metrics import cache_event_counts
from hearth.services.devtools.managed_process import metrics_port_in
from hearth.protocol.chat_frames import DoneFrame, ErrorFrame, KeepaliveFrame, Timing, Usage
from hearth.services.common.metrics import (
    counter,
    metrics_observed,
    render_metrics,
    sample_value,
    serve_process_metrics,
    set_metrics_observed,
)
from hearth.services.orchestrator.metrics import HopLatencies, count_request, final_frame_code, observe_event
from hearth.services.shard.metrics import ServingStats, watch_serving
from hearth.services.transport import FrameKind

SHARDS = ["m:0-1@a", "m:2-3@b", "m:4-5@c"]


@pytest.fixture
def observing():
    """Per-step observations on for the test, as they were afterwards."""
    before = metrics_observed()
    set_metrics_observed(True)
    # None leaves them as they are.
    assert serve_process_metrics(None, "test", host="127.0.0.1") is None and metrics_observed()
    yield
    set_metrics_observed(before)


def latency_count(shard_id: str) -> float:
    return sample_value("hearth_shard_latency_seconds_count", {"shard_id": shard_id})


def test_each_hop_is_timed_from_its_first_ack_to_the_next_hops_or_to_the_output(observing):
    latencies = HopLatencies(SHARDS)
    counts = [latency_count(shard) for shard in SHARDS]
    total_before = sample_value("hearth_shard_latency_seconds_sum", {"shard_id": SHARDS[1]})
    # Hop 2's ack was not seen: hop 1 has no end, hop 2 no start; hop 0 and the sink's arrival still count.
    latencies.observe({0: 10.0, 1: 10.25}, output_at=11.0)
    assert [latency_count(shard) - before for shard, before in zip(SHARDS, counts)] == [1, 0, 0]
    latencies.observe({0: 20.0, 1: 20.25, 2: 20.75}, output_at=21.0)
    assert [latency_count(shard) - before for shard, before in zip(SHARDS, counts)] == [2, 1, 1]
    assert sample_value("hearth_shard_latency_seconds_sum", {"shard_id": SHARDS[1]}) - total_before == 0.5


def turn_count() -> float:
    return sample_value("hearth_orchestrator_turn_seconds_count")


def test_the_orchestrators_turn_runs_from_an_output_to_the_next_decode_step_sent(observing):
    latencies = HopLatencies(SHARDS)
    before, hop_before = turn_count(), latency_count(SHARDS[0])
    latencies.step_sent(FrameKind.decode)  # no output yet (a chain's first step): no turn
    assert turn_count() == before
    latencies.output_reached({0: 1.0, 1: 2.0, 2: 3.0})  # the hops' shares are observed with it
    assert latency_count(SHARDS[0]) == hop_before + 1
    latencies.step_sent(FrameKind.decode)
    assert turn_count() == before + 1
    latencies.step_sent(FrameKind.decode)  # the turn ended with the step sent: one turn per output
    latencies.output_reached(None)  # shares unknown (a step held up behind another): the turn still begins
    latencies.step_sent(FrameKind.prefill)  # a re-prefill after it: no decode turn, and the output is forgotten
    latencies.step_sent(FrameKind.decode)
    assert turn_count() == before + 1 and latency_count(SHARDS[0]) == hop_before + 1
    latencies.output_reached(None)
    latencies.step_sent(FrameKind.decode)
    assert turn_count() == before + 2


def test_metrics_port_0_turns_the_per_step_observations_off(observing):
    latencies = HopLatencies(SHARDS)
    before = latency_count(SHARDS[0])
    assert serve_process_metrics(0, "test", host="127.0.0.1") is None
    latencies.observe({0: 1.0, 1: 2.0, 2: 3.0}, output_at=4.0)
    assert latency_count(SHARDS[0]) == before
    turns = turn_count()
    latencies.output_reached(None)
    latencies.step_sent(FrameKind.decode)
    assert turn_count() == turns


def test_a_calls_events_feed_the_orchestrator_metrics(observing):
    common = {"node_id": "orch", "pipeline_id": "p-1"}
    before = {
        "ttft": sample_value("hearth_first_token_seconds_count"),
        "failovers": sample_value("hearth_failovers_total", {"reason": "stalled"}),
        "fallbacks": sample_value("hearth_fallback_to_local_total"),
        "corrupt": sample_value("hearth_shard_corruption_detected_total", {"shard_id": SHARDS[0], "check": "nan"}),
    }
    observe_event(PipelineFirstToken(ttft_ms=250.0, **common))
    observe_event(PipelineFailover(failed_shard_id=SHARDS[0], replacement_hops=SHARDS[1:], reason="stalled",
                                   resumed_at_token=3, **common))
    observe_event(PipelineFallbackLocal(reason="no shards", **common))
    observe_event(IntegrityCorruptionDetected(shard_id=SHARDS[0], check="nan", **common))
    assert sample_value("hearth_first_token_seconds_count") == before["ttft"] + 1
    assert sample_value("hearth_failovers_total", {"reason": "stalled"}) == before["failovers"] + 1
    assert sample_value("hearth_fallback_to_local_total") == before["fallbacks"] + 1
    assert sample_value("hearth_shard_corruption_detected_total",
                        {"shard_id": SHARDS[0], "check": "nan"}) == before["corrupt"] + 1


def test_a_call_is_counted_by_its_final_frame_or_by_why_it_had_none():
    done = DoneFrame(seq=3, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1),
                     timing=Timing(ttft_ms=1.0, tokens_per_second=1.0, duration_ms=1.0))
    assert final_frame_code(done) == "ok"
    assert final_frame_code(ErrorFrame(seq=0, code="overloaded", message="busy")) == "overloaded"
    assert final_frame_code(KeepaliveFrame(seq=0)) is None
    for code, gone, label in (("ok", False, "ok"), (None, True, "client_gone"), (None, False, "orchestrator_gone")):
        before = sample_value("hearth_requests_total", {"code": label})
        count_request(code, gone)
        assert sample_value("hearth_requests_total", {"code": label}) == before + 1
    # Every error code reads 0 from the start, not nothing.
    assert 'hearth_requests_total{code="shard_unavailable"}' in render_metrics()


class WatchedShard:
    """What the serving collector reads off a shard, set by the test."""

    shard_id = "m:0-5@x"
    figures = (0, 0, 0)
    events = (0, 0)

    def serving_figures(self):
        return self.figures

    def cache_event_figures(self):
        return self.events


def test_a_shards_serving_figures_are_read_at_scrape_time():
    registry, shard = CollectorRegistry(), WatchedShard()
    shard.figures = (2, 4096, 17)
    watch_serving(shard, registry=registry)
    labels = {"shard_id": shard.shard_id}
    assert sample_value("hearth_shard_active_sessions", labels, registry=registry) == 2
    assert sample_value("hearth_shard_kv_cache_bytes", labels, registry=registry) == 4096
    shard.figures = (0, 0, 40)
    assert sample_value("hearth_shard_tokens_served_total", labels, registry=registry) == 40
    assert sample_value("hearth_shard_active_sessions", labels, registry=registry) == 0


def test_a_shards_evictions_and_graph_captures_are_counters_the_bench_reads_as_differences():
    registry, shard = CollectorRegistry(), WatchedShard()
    shard.events = (3, 0)
    watch_serving(shard, registry=registry)
    labels = {"shard_id": shard.shard_id}
    assert sample_value("hearth_shard_kv_evictions_total", labels, registry=registry) == 3
    assert sample_value("hearth_shard_cuda_graph_captures_total", labels, registry=registry) == 0
    shard.events = (5, 12)
    assert sample_value("hearth_shard_cuda_graph_captures_total", labels, registry=registry) == 12
    before = {"m:0-5@x": (3.0, 0.0), "m:6-9@y": (1.0, 4.0)}
    after = {"m:0-5@x": (5.0, 12.0), "m:6-9@y": (1.0, 4.0), "m:10-11@z": (0.0, 2.0)}
    assert cache_event_counts(after, before) == {"m:0-5@x": {"kv_evictions": 2, "graph_captures": 12},
                                                 "m:10-11@z": {"kv_evictions": 0, "graph_captures": 2}}


def test_a_registry_made_after_another_was_freed_gets_its_own_collectors():
    # CPython hands a freed registry's id to the next one made: collectors kept by id went to the dead registry.
    for _ in range(8):
        registry, shard = CollectorRegistry(), WatchedShard()
        shard.events = (3, 0)
        watch_serving(shard, registry=registry)
        counter("hearth_test_registry_reuse", "A counter of a short-lived registry.", registry=registry).inc()
        assert sample_value("hearth_shard_kv_evictions_total", {"shard_id": shard.shard_id}, registry=registry) == 3
        assert sample_value("hearth_test_registry_reuse_total", registry=registry) == 1
        del registry, shard
        gc.collect()


@pytest.mark.parametrize(("args", "port"), [
    (["shard", "--layers", "0-1"], None),
    (["shard", "--metrics-port", "9101"], 9101),
    (["projector", "--metrics-port=0", "--metrics-port", "9"], 9),
])
def test_local_cluster_reads_a_metrics_port_given_in_the_arguments(args, port):
    assert metrics_port_in(args) == port


def test_a_shards_heartbeat_p95_is_the_nearest_rank_one_not_the_slowest_step():
    stats = ServingStats()
    stats.step_latencies_s.extend(step_ms / 1000.0 for step_ms in range(1, 21))
    # 19 of the 20 steps took at most 19 ms: that is the p95, the 20 ms step is the slowest only.
    assert stats.p95_latency_ms() == pytest.approx(19.0)
    assert ServingStats().p95_latency_ms() == 0.0

"""The arithmetic of `hearth bench`: percentiles from Prometheus buckets, timing figures, prompt lengths, batch
sizes, which shards merge decoding groups."""

from __future__ import annotations

import math

import pytest

from hearth.services.devtools.bench.runner import all_decoding_rate
from hearth.services.devtools.bench.timing import GenerationTiming, tokens_before_divergence
from hearth.services.devtools.bench.transport_metrics import Histogram, mean_batch_rows, transport_figures
from hearth.services.devtools.local_cluster import (BATCH_MERGE_WINDOW_ENV, LocalCluster, _device_argument,
                              shared_machine_batch_merge_window_ms)
from hearth.services.shard.metrics import COMPUTE_METRIC, TRANSPORT_METRIC, WIRE_METRIC

BOUNDS_S = [0.0005, 0.001, 0.002, math.inf]


def histogram(counts_per_bucket: list[int], sum_s: float = 0.0) -> Histogram:
    cumulative, total = [], 0
    for count in counts_per_bucket:
        total += count
        cumulative.append(total)
    return Histogram(BOUNDS_S, cumulative, sum_s)


def test_quantile_interpolates_inside_the_bucket_holding_the_rank():
    h = histogram([50, 40, 10, 0])  # 100 observations
    assert h.quantile_ms(0.5) == pytest.approx(0.5)  # rank 50: the top of the first bucket
    assert h.quantile_ms(0.95) == pytest.approx(1.5)  # rank 95: halfway through (1 ms, 2 ms]
    assert h.quantile_ms(0.25) == pytest.approx(0.25)  # inside the first bucket, from 0


def test_quantile_in_the_overflow_bucket_reports_the_last_finite_bound():
    h = histogram([0, 0, 1, 9])
    assert h.quantile_ms(0.95) == pytest.approx(2.0)


def test_share_at_most_a_bucket_bound_is_exact_and_other_bounds_are_refused():
    h = histogram([50, 40, 10, 0])
    assert h.share_at_most(0.001) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        h.share_at_most(0.0015)


def test_a_window_is_the_difference_of_two_scrapes():
    earlier = histogram([10, 0, 0, 0], sum_s=0.003)
    later = histogram([10, 5, 1, 0], sum_s=0.0115)
    window = later.minus(earlier)
    assert window.count == 6
    assert window.cumulative == [0, 5, 6, 6]
    assert window.mean_ms == pytest.approx(8.5 / 6)
    assert histogram([0, 0, 0, 0]).quantile_ms(0.5) is None


def test_transport_figures_per_hop_and_pooled():
    delta = {
        (TRANSPORT_METRIC, "m:0-1@a", "decode"): histogram([10, 0, 0, 0], sum_s=0.004),
        (TRANSPORT_METRIC, "m:2-3@b", "decode"): histogram([0, 10, 0, 0], sum_s=0.008),
        (TRANSPORT_METRIC, "m:2-3@b", "prefill"): histogram([0, 0, 0, 3]),
        (WIRE_METRIC, "m:0-1@a", "decode"): histogram([10, 0, 0, 0]),
        (COMPUTE_METRIC, "m:0-1@a", "decode"): histogram([0, 0, 0, 10], sum_s=0.5),
    }
    rows = transport_figures(delta, "decode", {"m:0-1@a": 0, "m:2-3@b": 1})
    assert [(row.hop, row.shard_id, row.steps) for row in rows] == [(0, "m:0-1@a", 10), (1, "m:2-3@b", 10),
                                                                     (None, "all", 20)]
    assert rows[0].p95_ms == pytest.approx(0.475)
    assert rows[1].share_at_most_1ms == 1.0
    assert rows[2].p50_ms == pytest.approx(0.5)
    assert rows[2].mean_ms == pytest.approx(0.6)
    assert rows[0].compute_mean_ms == pytest.approx(50.0)
    assert rows[1].wire_p50_ms is None


def test_generation_timing_counts_decode_rate_from_the_first_token_on():
    timing = GenerationTiming(token_times_s=[0.5, 0.6, 0.7, 0.9])
    assert timing.ttft_ms == pytest.approx(500.0)
    assert timing.decode_tokens_per_s == pytest.approx(3 / 0.4)
    assert GenerationTiming(token_times_s=[0.5]).decode_tokens_per_s == 0.0


def test_all_decoding_rate_counts_only_the_tokens_after_every_session_started():
    # Session 1's first token comes at 2.0 s: from then on, tokens at 2.5, 3.0 (session 0) and 3.0, 4.0 (session 1).
    rate = all_decoding_rate([[0.5, 1.0, 2.5, 3.0], [2.0, 3.0, 4.0]])
    assert rate == pytest.approx(4 / 2.0)
    # A session that starts after the others have finished leaves no span where all decode.
    assert all_decoding_rate([[0.5, 1.0], [2.0]]) is None


def test_mean_batch_rows_is_rows_per_batch_between_two_scrapes():
    before = {"a": (10.0, 12.0), "b": (5.0, 5.0)}
    after = {"a": (20.0, 52.0), "b": (5.0, 5.0), "c": (2.0, 3.0)}
    # a: 40 rows in 10 batches; b batched nothing meanwhile (left out); c is new since the first scrape.
    assert mean_batch_rows(after, before) == {"a": pytest.approx(4.0), "c": pytest.approx(1.5)}


def test_tokens_before_divergence_is_the_shortest_shared_prefix_of_every_run():
    reference = [5, 6, 7, 8]
    assert tokens_before_divergence([[5, 6, 7, 8], [5, 6, 7, 8]], reference) == 4
    assert tokens_before_divergence([[5, 6, 7, 8], [5, 6, 9, 8], [5, 1, 7, 8]], reference) == 1
    assert tokens_before_divergence([[9, 6, 7, 8]], reference) == 0
    assert tokens_before_divergence([[5, 6]], reference) == 2  # a run that stopped early agrees only so far
    assert tokens_before_divergence([], reference) == 4


@pytest.mark.parametrize(("device", "cpus", "merges"), [(None, None, True), ("cpu", None, True), ("cuda", None, False),
                                                        ("cuda:1", None, False), ("cpu", [0], False)])
def test_only_shards_sharing_the_cpu_cores_for_their_steps_merge_decoding_groups(monkeypatch, device, cpus, merges):
    monkeypatch.delenv(BATCH_MERGE_WINDOW_ENV, raising=False)
    with LocalCluster() as cluster:
        env = cluster.shared_machine_shard_env(cpus, device)
    assert env == ({BATCH_MERGE_WINDOW_ENV: repr(shared_machine_batch_merge_window_ms)} if merges else {})


def test_the_device_a_shard_starts_on_is_read_from_its_arguments():
    # LocalCluster.start_shard / start_host pass it to shared_machine_shard_env (above).
    assert _device_argument(["shard", "--layers", "0-1", "--device", "cuda:0"]) == "cuda:0"
    assert _device_argument(["host", "--device=cuda"]) == "cuda"
    assert _device_argument(["shard", "--layers", "0-1"]) is None


@pytest.mark.parametrize(("baseline", "named"), [("generate", "generate()"), ("hearth_local", "one process")])
def test_the_report_names_the_baseline_it_compared_with(baseline, named):
    from hearth.services.devtools.bench.report import BenchReport, format_report, side_figures
    from hearth.services.devtools.bench.targets import target_checks

    side = side_figures([GenerationTiming(token_times_s=[0.1, 0.2, 0.3], token_ids=[1, 2, 3])])
    report = BenchReport(
        started_at="now", machine={"cpus": 2, "torch": "x"},
        model={"spec": "m.gguf", "layers": 2, "parameters": 1e6, "dtype": "float32"},
        settings={"monolithic_baseline": baseline, "shards": 2, "layer_ranges": ["0-0", "1-1"], "prompt_tokens": 4,
                  "new_tokens": 3, "repeats": 1},
        monolithic=side, pipeline=side, greedy_outputs_match=True, ratio_median=1.0, ratio_of_medians=1.0,
        pipeline_overhead_ms_per_token=0.0, construct_ms_p50=None, construct_ms_max=None, transport_decode=[],
        transport_prefill=[], concurrent=None, targets=[])
    report.targets = target_checks(report)
    text = format_report(report)
    assert f"{named}, same thread settings" in text
    assert report.targets[0].target.endswith(f"x monolithic {named}")
    assert ("generate()" in text) == (baseline == "generate")

"""The bench's split of a decode token's time (hearth/services/devtools/bench/token_budget.py): the orchestrator's
timings read off its /metrics, and the split computed from them and the hops' figures."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from hearth.services.devtools.bench.report import TransportFigures, budget_line
from hearth.services.devtools.bench.token_budget import parse_orchestrator_timings, token_budget
from hearth.services.orchestrator.metrics import HEAD_STEP_METRIC, ORCHESTRATOR_TURN_METRIC


def exposition(turns_s: list[float], heads_s: list[float]) -> str:
    registry = CollectorRegistry()
    turn = Histogram(ORCHESTRATOR_TURN_METRIC, "turn", registry=registry)
    head = Histogram(HEAD_STEP_METRIC, "head", registry=registry)
    for value in turns_s:
        turn.observe(value)
    for value in heads_s:
        head.observe(value)
    Histogram("hearth_other_seconds", "not ours", registry=registry).observe(9.0)
    return generate_latest(registry).decode()


def hop_row(hop: int | None, compute_ms: float | None, transport_ms: float | None) -> TransportFigures:
    return TransportFigures(hop=hop, shard_id="all" if hop is None else f"m:{hop}@h", steps=10, p50_ms=None,
                            p95_ms=None, share_at_most_1ms=None, wire_p50_ms=None, wire_p95_ms=None,
                            deserialize_p95_ms=None, serialize_p95_ms=None, mean_ms=transport_ms,
                            compute_mean_ms=compute_ms)


def test_the_orchestrators_timings_are_read_as_their_histograms():
    timings = parse_orchestrator_timings(exposition([0.004, 0.006], [0.002]))
    assert set(timings) == {ORCHESTRATOR_TURN_METRIC, HEAD_STEP_METRIC}
    turn, head = timings[ORCHESTRATOR_TURN_METRIC], timings[HEAD_STEP_METRIC]
    assert (turn.count, head.count) == (2, 1)
    assert turn.mean_ms == pytest.approx(5.0) and head.mean_ms == pytest.approx(2.0)
    assert turn.share_at_most(0.005) == pytest.approx(0.5)  # the buckets come along, in order


def test_a_tokens_time_is_split_into_the_hops_the_orchestrators_turn_and_the_rest():
    before = parse_orchestrator_timings(exposition([0.5], [0.25]))  # observed before the measured runs
    after = parse_orchestrator_timings(exposition([0.5, 0.003, 0.005], [0.25, 0.001, 0.002]))
    hops = [hop_row(0, 9.0, 1.0), hop_row(1, 8.0, 1.5), hop_row(2, 7.0, 0.5), hop_row(None, 8.0, 1.0)]
    budget = token_budget(25.0, hops, after, before)  # 25 tokens/s: 40 ms a token
    assert budget.token_ms == pytest.approx(40.0)
    assert budget.hops_compute_ms == pytest.approx(24.0)  # the pooled row is not counted again
    assert budget.hops_transport_ms == pytest.approx(3.0)
    assert budget.orchestrator_turn_ms == pytest.approx(4.0)  # only what the runs observed: (3 + 5) / 2
    assert budget.head_step_ms == pytest.approx(1.5)
    assert budget.other_ms == pytest.approx(40.0 - 24.0 - 3.0 - 4.0)
    assert "a decode token: 40.00 ms = hops' compute 24.00" in budget_line(budget)


def test_a_part_not_measured_leaves_the_rest_unknown():
    hops = [hop_row(0, 9.0, 1.0), hop_row(1, None, 1.0)]
    budget = token_budget(20.0, hops, None, None)  # metrics off: no orchestrator scrape
    assert budget.token_ms == pytest.approx(50.0)
    assert budget.hops_compute_ms is None and budget.hops_transport_ms == pytest.approx(2.0)
    assert budget.orchestrator_turn_ms is None and budget.head_step_ms is None and budget.other_ms is None
    assert "n/a" in budget_line(budget)
    # A scrape with no turn observed in between (no decode step) gives no turn either.
    timings = parse_orchestrator_timings(exposition([0.5], [0.25]))
    assert token_budget(20.0, hops, timings, timings).orchestrator_turn_ms is None

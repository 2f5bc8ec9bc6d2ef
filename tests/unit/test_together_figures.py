"""The arithmetic of `hearth bench --pin-cores`: end-to-end and decode-only aggregate tokens/s of concurrent
sessions, and the per-session-count verdicts."""

from __future__ import annotations

import pytest

from hearth.services.devtools.bench.report import TargetCheck
from hearth.services.devtools.bench.timing import GenerationTiming
from hearth.services.devtools.bench.together_report import SessionsRun, TogetherReport, aggregate_rates, together_checks


def test_aggregates_count_all_tokens_over_the_wall_and_decode_after_the_last_first_token():
    # Session a: sent at 0, tokens at 1, 2, 3; session b: sent at 0.5, tokens at 2, 3, 4 (absolute 2.5, 3.5, 4.5).
    a = GenerationTiming(token_times_s=[1.0, 2.0, 3.0])
    b = GenerationTiming(token_times_s=[2.0, 3.0, 4.0])
    end_to_end, decode = aggregate_rates([(0.0, a), (0.5, b)], wall_s=5.0)
    assert end_to_end == pytest.approx(6 / 5.0)
    # Every session decoding from 2.5 (b's first token): a's 3.0, b's 3.5 and 4.5 came after, over 2.0 s.
    assert decode == pytest.approx(3 / 2.0)


def test_decode_aggregate_is_absent_when_nothing_came_after_the_last_first_token():
    one_token = GenerationTiming(token_times_s=[1.0])
    assert aggregate_rates([(0.0, one_token)], wall_s=1.0) == (pytest.approx(1.0), None)


def _run(sessions: int, ratio: float, match: bool = True, paired: float | None = None) -> SessionsRun:
    return SessionsRun(paired_ratio=paired, sessions=sessions, repeat=0, load_average_1m=1.0, wall_s=1.0, tokens=8,
                       aggregate_tokens_per_s=8.0, decode_aggregate_tokens_per_s=None, ratio=ratio, decode_ratio=None,
                       outputs_match_solo=match, cpu_s={}, cpu_ms_per_token={}, cpu_time_ratio=1.0)


def test_verdict_per_session_count_is_the_median_ratio_and_needs_matching_outputs():
    report = TogetherReport(
        started_at="", machine={"cores_used": [0, 1]}, model={}, settings={}, pinned=[], baselines=[],
        baseline_used="", baseline_end_to_end_tokens_per_s=1.0, baseline_decode_tokens_per_s=1.0,
        baseline_paths_agree=True,
        runs=[_run(2, 0.7), _run(2, 0.9), _run(2, 0.85), _run(4, 0.95, match=False),
              _run(8, 0.95, paired=0.6), _run(8, 0.95, paired=0.7)])
    checks = together_checks(report)
    # The paired ratio, where there is one, decides: the fastest baseline run may come from a quieter minute.
    assert [check.met for check in checks] == [True, False, False]
    assert checks[2].measured.startswith("0.650 paired")
    assert all(isinstance(check, TargetCheck) for check in checks)
    assert "0.850" in checks[0].measured and "DIFFER" in checks[1].measured

"""`hearth bench --verify/--replicas`: refused at the command line naming the option, carried into the options and
the report; the orchestrator's verification counter as the bench reads it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.devtools.bench import command
from hearth.services.devtools.bench.mesh import replica_cores, replica_node_id
from hearth.services.devtools.bench.report import BenchReport, Side, verification_line
from hearth.services.devtools.bench.verification_metrics import (CHECKS_SAMPLE, checks_between, checks_with_verdict,
                                                          parse_verification_checks)


@pytest.mark.parametrize(("arguments", "option", "named"), [
    (["--verify", "most"], "--verify", "'most'"),
    (["--replicas", "0"], "--replicas", "got 0"),
    (["--pin-cores", "2", "--verify", "all"], "--verify", "--pin-cores"),
    (["--pin-cores", "2", "--replicas", "2"], "--replicas", "--pin-cores"),
])
def test_a_bad_verification_option_is_refused_naming_it_before_starting_anything(arguments, option, named):
    result = CliRunner().invoke(app, ["bench", *arguments])
    assert result.exit_code == 2
    assert option in result.output and named in result.output


@pytest.fixture
def bench_options(monkeypatch):
    """The BenchOptions `hearth bench` would run with (the run itself replaced)."""
    received = []

    def run_bench(options, *, as_json):
        received.append(options)
        return 0

    monkeypatch.setattr(command, "run_bench_command", run_bench)
    return received


def test_the_options_reach_the_bench_and_default_to_the_protocols_level_on_one_replica(bench_options):
    assert CliRunner().invoke(app, ["bench", "--verify", "vote", "--replicas", "3"]).exit_code == 0
    assert CliRunner().invoke(app, ["bench"]).exit_code == 0
    chosen, default = bench_options
    assert (chosen.verify, chosen.replicas, chosen.verify_level) == ("vote", 3, "vote")
    assert (default.verify, default.replicas, default.verify_level) == (None, 1, "sampled")


def test_a_level_no_replica_can_check_is_run_with_a_warning(bench_options):
    result = CliRunner().invoke(app, ["bench", "--verify", "all"])
    assert result.exit_code == 0 and "no_replica" in result.output
    assert bench_options[0].verify == "all"
    assert "no_replica" not in CliRunner().invoke(app, ["bench", "--verify", "all", "--replicas", "2"]).output


def test_each_replica_of_a_range_has_a_node_of_its_own_and_the_first_keeps_the_old_name():
    names = [replica_node_id(hop, replica) for hop in range(3) for replica in range(3)]
    assert len(set(names)) == len(names)
    assert replica_node_id(1, 0) == "bench-host-1"


def test_pinned_replicas_get_cores_of_their_own():
    assert [replica_cores(replica, 2) for replica in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert replica_cores(1, None) is None


def test_the_report_says_the_level_the_replicas_and_what_the_checks_found():
    side = Side(runs=[], decode_tokens_per_s_median=1.0, ttft_ms_median=1.0)
    report = BenchReport(started_at="", machine={}, model={}, settings={"verify": "all", "replicas": 2},
                         monolithic=side, pipeline=side, greedy_outputs_match=True, ratio_median=1.0,
                         ratio_of_medians=1.0, pipeline_overhead_ms_per_token=0.0, construct_ms_p50=None,
                         construct_ms_max=None, transport_decode=[], transport_prefill=[], concurrent=None,
                         targets=[], verification_checks={"confirmed": 12, "mismatch": 0})
    line = verification_line(report)
    assert line.startswith("verification all, 2 replica(s)") and "confirmed 12" in line
    assert BenchReport.model_validate_json(report.model_dump_json()).verification_checks == {"confirmed": 12,
                                                                                              "mismatch": 0}


def test_the_bench_reads_the_counter_the_orchestrator_exposes():
    from prometheus_client import REGISTRY, generate_latest

    from hearth.services.orchestrator.check_policy import CHECK_OUTCOMES
    from hearth.services.orchestrator.metrics import verification_checks_total

    assert CHECKS_SAMPLE == verification_checks_total.describe()[0].name + "_total"
    before = parse_verification_checks(generate_latest(REGISTRY).decode())
    assert set(before) == set(CHECK_OUTCOMES)
    verification_checks_total.labels("confirmed").inc(4)
    verification_checks_total.labels("disputed").inc()
    delta = checks_between(parse_verification_checks(generate_latest(REGISTRY).decode()), before)
    assert delta == {**{outcome: 0 for outcome in CHECK_OUTCOMES}, "confirmed": 4, "disputed": 1}


def test_a_clean_check_confirms_the_hop_and_each_mirror_and_a_mismatch_counts_once():
    delta = {"confirmed": 12, "mismatch": 1, "disputed": 2, "no_replica": 5}
    assert checks_with_verdict(delta, "all") == 12 // 2 + 3
    assert checks_with_verdict(delta, "vote") == 12 // 3 + 3
    assert checks_with_verdict(delta, "none") == 0

"""The recovery policy, row by row: what a call does after a routing or step failure (re-prefill, rebuild after
broker loss, fail over, fall back to local, abort) for the call's counters and the settings."""

from __future__ import annotations

import pytest

from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.outcomes import RoutingFailure, StepFailure
from hearth.services.orchestrator.recovery import (
    PIPELINE_STALLED,
    SHARD_UNAVAILABLE,
    Action,
    CallCounters,
    Decision,
    RecoveryLimits,
    decide,
)

LIMITS = RecoveryLimits(max_eviction_reprefills=2, fallback_to_local_after_failures=2, max_broker_repairs=3,
                        fallback_to_local=True)
NO_FALLBACK = RecoveryLimits(max_eviction_reprefills=2, fallback_to_local_after_failures=2, max_broker_repairs=3,
                             fallback_to_local=False)
STALLED = StepFailure("stalled", "m:0-3@a", "step 7 not passed on within 10.0 s")
BROKER = StepFailure("broker", None, "the connection to the NATS broker at hub:4222 was lost while step 3 was out")
EVICTED = StepFailure("evicted", "m:4-7@b", "step 9: its session was evicted: kv budget")


def test_no_first_chain_falls_back_with_the_routers_code_and_message():
    failure = RoutingFailure("overloaded", "no shard had room for this call within 30 s")
    assert decide(failure, CallCounters(), LIMITS) == Decision(Action.fall_back, code="overloaded",
                                                               reason="no shard had room for this call within 30 s")


@pytest.mark.parametrize("counters,limits", [
    (CallCounters(fallback_requested=False), LIMITS),
    (CallCounters(), NO_FALLBACK),
])
def test_no_first_chain_aborts_when_the_request_or_the_config_forbids_fallback(counters, limits):
    failure = RoutingFailure("shard_unavailable", "no shard serves layers 4-7")
    assert decide(failure, counters, limits) == Decision(Action.abort, code="shard_unavailable",
                                                         reason="no shard serves layers 4-7")


def test_no_replacement_chain_falls_back_as_shard_unavailable_naming_the_failed_shard():
    failure = RoutingFailure("overloaded", "no room", replacing=STALLED)
    decision = decide(failure, CallCounters(failovers=1), LIMITS)
    assert decision == Decision(Action.fall_back, code=SHARD_UNAVAILABLE,
                                reason="no replacement for m:0-3@a: no room")
    assert decide(failure, CallCounters(failovers=1), NO_FALLBACK).action is Action.abort


def test_an_evicted_session_is_re_prefilled_on_the_same_chain_within_the_bound():
    assert decide(EVICTED, CallCounters(eviction_reprefills=1), LIMITS) == Decision(Action.reprefill)


def test_an_evicted_session_past_the_bound_fails_over_around_its_shard():
    decision = decide(EVICTED, CallCounters(eviction_reprefills=2), LIMITS)
    assert decision == Decision(Action.fail_over, route_around="m:4-7@b")


def test_a_lost_broker_rebuilds_the_same_hops_within_the_repairs_allowed():
    assert decide(BROKER, CallCounters(broker_repairs=2), LIMITS) == Decision(Action.rebuild)


def test_a_lost_broker_past_the_repairs_allowed_aborts_stalled_without_blaming_a_shard():
    decision = decide(BROKER, CallCounters(broker_repairs=3), LIMITS)
    assert decision == Decision(Action.abort, code=PIPELINE_STALLED, reason=f"{BROKER.reason} (rebuilt 3 times)")


def test_a_lost_broker_with_no_hops_to_reopen_aborts_stalled():
    decision = decide(BROKER, CallCounters(has_hops=False), LIMITS)
    assert decision.action is Action.abort and decision.code == PIPELINE_STALLED
    assert decision.route_around is None


@pytest.mark.parametrize("kind", ["stalled", "step_failed", "corrupt", "reported", "gone", "refused", "refuted",
                                  "disputed"])
def test_a_failed_shard_is_failed_over_while_failovers_remain(kind):
    failure = StepFailure(kind, "m:0-3@a", "it failed")
    assert decide(failure, CallCounters(failovers=1), LIMITS) == Decision(Action.fail_over, route_around="m:0-3@a")


def test_a_shard_proved_wrong_is_blamed_one_only_disputed_is_not():
    assert StepFailure("refuted", "m:0-3@a", "refuted", rewind_to=4).verified
    assert not StepFailure("disputed", "m:0-3@a", "disputed", rewind_to=4).verified


def test_a_failed_shard_after_the_last_failover_falls_back_routing_around_it():
    decision = decide(STALLED, CallCounters(failovers=2), LIMITS)
    assert decision == Decision(Action.fall_back, route_around="m:0-3@a", code=SHARD_UNAVAILABLE,
                                reason=f"2 failovers; last: {STALLED}")


def test_a_failed_shard_after_the_last_failover_aborts_when_fallback_is_forbidden():
    decision = decide(STALLED, CallCounters(failovers=2, fallback_requested=False), LIMITS)
    assert decision == Decision(Action.abort, route_around="m:0-3@a", code=SHARD_UNAVAILABLE,
                                reason=f"2 failovers; last: {STALLED}")


def test_no_failovers_allowed_falls_back_at_the_first_shard_failure():
    limits = RecoveryLimits(max_eviction_reprefills=0, fallback_to_local_after_failures=0, max_broker_repairs=0,
                            fallback_to_local=True)
    assert decide(STALLED, CallCounters(), limits).action is Action.fall_back
    assert decide(EVICTED, CallCounters(), limits).action is Action.fall_back
    assert decide(BROKER, CallCounters(), limits).action is Action.abort


def test_the_limits_are_read_from_their_settings():
    settings = HearthSettings.model_validate({
        "research": {"distributed_inference": {"max_eviction_reprefills": 5, "fallback_to_local_after_failures": 1,
                                               "fallback_to_local": False}},
        "orchestrator": {"max_broker_repairs": 7},
    })
    assert RecoveryLimits.from_settings(settings) == RecoveryLimits(
        max_eviction_reprefills=5, fallback_to_local_after_failures=1, max_broker_repairs=7, fallback_to_local=False)

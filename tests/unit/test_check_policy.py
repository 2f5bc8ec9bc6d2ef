"""When a `sampled` call checks a hop, and what that catches: a host that lies on 1 % of its steps, subtly enough that
no guard notices, is caught within 20 calls of 64 tokens at the default sample rate (issue 28's target), over many
seeded runs and against the calculation."""

from __future__ import annotations

import random

from hearth.services.common.config_processes import VerificationSettings
from hearth.services.orchestrator.check_policy import sampled_check_due

LIE_RATE = 0.01
CALLS = 20
STEPS_PER_CALL = 64  # the prefill and 63 decode steps of a 64-token answer
RUNS = 2000


def test_a_chain_is_checked_at_its_first_step_until_its_range_learned_and_then_by_guard_or_draw():
    due = dict(suspect=False, draw=0.5, sample_rate=0.02)
    assert sampled_check_due(first_step=True, learned=False, **due) == "first step"
    assert sampled_check_due(first_step=True, learned=True, **due) is None
    assert sampled_check_due(first_step=False, learned=True, **{**due, "suspect": True}) == "guard"
    assert sampled_check_due(first_step=False, learned=True, **{**due, "draw": 0.01}) == "sampled"
    # A record past half its budget forgets only what checks read: they are made, whatever the draw.
    assert sampled_check_due(first_step=False, learned=True, record_filling=True, **due) == "record filling"


def caught_within(calls: int, chance: random.Random, sample_rate: float) -> bool:
    """One host's life: a check covers every step since the hop's last check, so a call catches the host when any
    check comes at or after its first lie."""
    for call in range(calls):
        first_lie = last_check = None
        for step in range(1, STEPS_PER_CALL + 1):
            if first_lie is None and chance.random() < LIE_RATE:
                first_lie = step
            if sampled_check_due(first_step=step == 1, learned=call > 0, suspect=False, draw=chance.random(),
                                 sample_rate=sample_rate):
                last_check = step
        if first_lie is not None and last_check is not None and last_check >= first_lie:
            return True
    return False


def calculated(sample_rate: float) -> float:
    """The chance a call without a first-step check misses the liar, raised to the calls (the first call's own
    first-step check only adds to it)."""
    miss = 1.0
    for step in range(1, STEPS_PER_CALL + 1):
        miss *= 1 - LIE_RATE * (1 - (1 - sample_rate) ** (STEPS_PER_CALL - step + 1))
    return 1 - miss ** CALLS


def test_a_host_lying_on_one_step_in_a_hundred_is_caught_within_twenty_calls_at_the_default_rate():
    sample_rate = VerificationSettings().sample_rate
    chance = random.Random(28)
    caught = sum(caught_within(CALLS, chance, sample_rate) for _ in range(RUNS)) / RUNS
    assert calculated(sample_rate) >= 0.99
    assert caught >= 0.99
    assert abs(caught - calculated(sample_rate)) < 0.01


def test_a_lower_rate_would_miss_the_target():
    assert calculated(0.005) < 0.99

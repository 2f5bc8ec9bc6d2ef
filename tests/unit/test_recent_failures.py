"""RecentFailures keeps shards that just failed a request out of routing for a while, then forgets them."""

from __future__ import annotations

from hearth.services.orchestrator.health import RecentFailures


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_shard_is_penalised_until_the_penalty_expires():
    clock = FakeClock()
    failures = RecentFailures(penalty_s=5.0, clock=clock)
    failures.add("a")
    clock.now += 3.0
    failures.add("b")
    assert failures.current() == {"a", "b"}
    clock.now += 2.0  # a's 5 s are over, b has 3 s left
    assert failures.current() == {"b"}
    clock.now += 3.0
    assert failures.current() == set()


def test_failing_again_extends_the_penalty():
    clock = FakeClock()
    failures = RecentFailures(penalty_s=5.0, clock=clock)
    failures.add("a")
    clock.now += 4.0
    failures.add("a")
    clock.now += 4.0
    assert failures.current() == {"a"}

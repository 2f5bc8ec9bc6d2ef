"""Unit tests of routing while the event log is silent: shards are judged against the newest heartbeat the read model
heard (for at most `silent_log_grace_s`), so a log that stops delivering is not read as every shard dead."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import sessionmaker

from hearth.readmodels.batch_rows import epoch_s
from hearth.services.orchestrator.router import RoutingError, ShardRouter, judged_instant
from tests.readmodel_helpers import (
    MODEL_ID,
    WEIGHTS_SHA,
    LogBuilder,
    advertised,
    apply_all,
    at,
    heartbeat,
    migrated_engine,
)

HEALTH_TIMEOUT_S = 10.0
GRACE_S = 30.0
TTL_S = 6.0


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "router.db")
    yield engine
    engine.dispose()


def add_shard(engine, log: LogBuilder, lo: int, hi: int, node: str, *, beats_at: float) -> str:
    """A shard advertised at 0 (renewed at `beats_at`, as hosts renew every ttl/3) and heard at `beats_at`."""
    first = advertised(lo, hi, node, t=0.0, ttl_s=TTL_S)
    renewed = advertised(lo, hi, node, t=beats_at, ttl_s=TTL_S)
    apply_all(engine, [log.stored(first), log.stored(renewed),
                       log.stored(heartbeat(first.shard_id, t=beats_at, node=node))])
    return first.shard_id


def routed(engine, wall_s: float, *, grace_s: float = GRACE_S) -> list[str]:
    router = ShardRouter(sessionmaker(engine), health_timeout_s=HEALTH_TIMEOUT_S, allow_self_as_shard=False,
                         self_node_id="hub", clock=lambda: epoch_s(at(wall_s)), silent_log_grace_s=grace_s)
    return [hop.shard_id.split("@")[1] for hop in router.pick(MODEL_ID, WEIGHTS_SHA)]


def test_a_silent_log_keeps_every_shard_routable(engine):
    log = LogBuilder()
    add_shard(engine, log, 0, 3, "a", beats_at=100.0)
    add_shard(engine, log, 4, 7, "b", beats_at=100.0)
    # Nothing heard for 20 s: past the health timeout and the adverts' expiry by the wall clock.
    assert routed(engine, 120.0) == ["a", "b"]
    # The wall clock alone (no grace) calls them all dead: the behaviour this rule replaces.
    with pytest.raises(RoutingError) as error:
        routed(engine, 120.0, grace_s=0.0)
    assert error.value.code == "shard_unavailable"


def test_a_shard_silent_while_others_are_heard_goes_stale(engine):
    log = LogBuilder()
    quiet = advertised(0, 7, "quiet", t=100.0, ttl_s=120.0)  # cheaper (see below), routed while it is heard
    spare = advertised(0, 7, "spare", t=100.0, ttl_s=120.0, hop_weight=3.0)
    apply_all(engine, [log.stored(quiet), log.stored(spare), log.stored(heartbeat(quiet.shard_id, t=100.0)),
                       log.stored(heartbeat(spare.shard_id, t=100.0))])
    assert routed(engine, 101.0) == ["quiet"]
    # The log goes on (spare is heard at 115) while quiet says nothing: quiet is 15 s behind the newest beat.
    apply_all(engine, [log.stored(heartbeat(spare.shard_id, t=115.0))])
    assert routed(engine, 116.0) == ["spare"]


def test_a_log_silent_beyond_the_grace_is_dead_shards_again(engine):
    log = LogBuilder()
    add_shard(engine, log, 0, 7, "a", beats_at=100.0)
    assert routed(engine, 100.0 + GRACE_S) == ["a"]
    with pytest.raises(RoutingError) as error:
        routed(engine, 100.0 + GRACE_S + HEALTH_TIMEOUT_S + 1)
    assert error.value.code == "shard_unavailable"


def test_a_clock_running_ahead_changes_nothing():
    assert judged_instant(1000.0, 1500.0, GRACE_S) == 1000.0  # a host's beat from the future
    assert judged_instant(1000.0, 990.0, GRACE_S) == 990.0
    assert judged_instant(1000.0, 900.0, GRACE_S) == 970.0
    assert judged_instant(1000.0, None, GRACE_S) == 1000.0
    assert judged_instant(1000.0, 990.0, 0.0) == 1000.0

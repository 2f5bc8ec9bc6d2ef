"""Unit tests of what a caller is told when the only shard for some layers is left out because its host's clock is
off the broker's beyond `[events] max_clock_skew_s`: the routing failure names the shard and says how far, which way
and the limit, as it does for every other shard it leaves out."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.signing import EventVerifier, sign_event
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.readmodels.projection import ReadModelProjection
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster
from tests.readmodel_helpers import MODEL_ID, WEIGHTS_SHA, LogBuilder, advertised, at, heartbeat, migrated_engine

HEALTH_TIMEOUT_S = 30.0
SKEW_S = 30.0


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "skew.db")
    yield engine
    engine.dispose()


def routing_failure(engine, wall_s: float) -> str:
    """What a call for the model is told at `wall_s` (broker's clock) when no chain can be built."""
    router = ShardRouter(sessionmaker(engine), health_timeout_s=HEALTH_TIMEOUT_S, allow_self_as_shard=False,
                         self_node_id="hub", clock=lambda: at(wall_s).timestamp(), max_clock_skew_s=SKEW_S)
    with pytest.raises(RoutingError) as failure:
        router.pick(MODEL_ID, WEIGHTS_SHA)
    assert failure.value.code == "shard_unavailable"
    return failure.value.message


class SkewedHost:
    """One signed host serving layers 0-7, whose events the broker stores at instants of its own clock."""

    def __init__(self, engine, node: str = "host0") -> None:
        self.engine, self.node, self.key, self.log = engine, node, MemberKey.generate(), LogBuilder()
        self.other_key = MemberKey.generate()
        roster = new_roster("t").with_member(new_member(node, "shard", self.key.public_key)).with_member(
            new_member("other", "shard", self.other_key.public_key))
        self.projection = ReadModelProjection(verifier=EventVerifier(roster, max_clock_skew_s=SKEW_S))
        self.shard_id = shard_id_for(MODEL_ID, 0, 7, node)

    def store(self, event, *, broker_s: float, key: MemberKey | None = None) -> None:
        message = replace(self.log.stored(sign_event(event, key or self.key)), time=at(broker_s))
        with Session(self.engine) as session, session.begin():
            self.projection.apply_many(session, [message])

    def advertise(self, *, dated_s: float, broker_s: float) -> None:
        self.store(advertised(0, 7, self.node, t=dated_s, ttl_s=600.0,
                              control_subject=shard_control_subject(self.node, self.shard_id)), broker_s=broker_s)

    def beat(self, *, dated_s: float, broker_s: float) -> None:
        self.store(heartbeat(self.shard_id, t=dated_s, node=self.node), broker_s=broker_s)


def test_a_shard_whose_host_is_far_behind_is_named_with_its_clock(engine):
    host = SkewedHost(engine)
    host.advertise(dated_s=100.0, broker_s=100.0)
    for n in range(30):  # then its clock falls 300 s behind; it beats every 2 s
        host.beat(dated_s=102.0 + 2 * n - 300.0, broker_s=102.0 + 2 * n)
    message = routing_failure(engine, 162.0)
    assert message.endswith(f"left out: {host.shard_id}: its clock is about 300 s behind the broker's "
                            f"(at most 30 s allowed)"), message


def test_a_shard_whose_host_is_far_ahead_is_named_with_its_clock(engine):
    """Its heartbeats are rejected (future_dated): its row ages, and says why."""
    host = SkewedHost(engine)
    host.advertise(dated_s=100.0, broker_s=100.0)
    host.beat(dated_s=101.0, broker_s=101.0)
    for n in range(30):  # then its clock runs 300 s ahead
        host.beat(dated_s=402.0 + 2 * n, broker_s=102.0 + 2 * n)
    message = routing_failure(engine, 162.0)
    assert message.endswith(f"left out: {host.shard_id}: its clock is about 300 s ahead of the broker's "
                            f"(at most 30 s allowed)"), message


def test_a_host_whose_clock_came_back_and_then_died_is_not_heard_from(engine):
    host = SkewedHost(engine)
    host.advertise(dated_s=100.0, broker_s=100.0)
    host.beat(dated_s=401.0, broker_s=101.0)  # ahead: rejected
    host.beat(dated_s=102.0, broker_s=102.0)  # set right again, then it stops
    message = routing_failure(engine, 200.0)
    assert message.endswith(f"left out: {host.shard_id}: not heard from for 98 s (health_timeout_s=30)"), message


def test_a_host_within_the_limit_that_died_is_not_said_to_be_off(engine):
    host = SkewedHost(engine)
    host.advertise(dated_s=80.0, broker_s=100.0)
    host.beat(dated_s=82.0, broker_s=102.0)  # 20 s behind: heard when stored
    message = routing_failure(engine, 200.0)
    assert "clock" not in message and "not heard from for 98 s" in message, message


def test_another_members_far_ahead_heartbeat_for_the_shard_changes_nothing(engine):
    """A member may sign heartbeats only for its own node; one naming another node's shard is not its clock."""
    host = SkewedHost(engine)
    host.advertise(dated_s=100.0, broker_s=100.0)
    host.beat(dated_s=101.0, broker_s=101.0)
    host.store(heartbeat(host.shard_id, t=402.0, node="other"), broker_s=102.0, key=host.other_key)
    message = routing_failure(engine, 200.0)
    assert "clock" not in message and "not heard from for 99 s" in message, message

"""Unit tests of a shard host whose clock is off: its heartbeats count from when the broker stored them while its
clock is within `[events] max_clock_skew_s` of the broker's, so a host just inside the limit stays alive between
beats, and one far behind stays left out (its opens would be refused as stale anyway)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.signing import EventVerifier, sign_event
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.readmodels.batch_rows import epoch_s
from hearth.readmodels.projection import ReadModelProjection, Rejection
from hearth.services.orchestrator.router import ShardRouter
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster
from tests.readmodel_helpers import MODEL_ID, LogBuilder, advertised, apply_all, at, heartbeat, migrated_engine

HEALTH_TIMEOUT_S = 30.0  # the defaults: [research.distributed_inference] shard_health_timeout_s
SKEW_S = 30.0  # and [events] max_clock_skew_s
BEAT_S = 2.0


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "skew.db")
    yield engine
    engine.dispose()


def stored_by_broker(log: LogBuilder, event, *, broker_s: float):
    """`event` (dated by its host's clock) as the broker stored it at `broker_s` by its own clock."""
    return replace(log.stored(event), time=at(broker_s))


def not_alive_because(engine, shard_id: str, wall_s: float) -> str | None:
    router = ShardRouter(sessionmaker(engine), health_timeout_s=HEALTH_TIMEOUT_S, allow_self_as_shard=False,
                         self_node_id="hub", clock=lambda: at(wall_s).timestamp())
    (shard,) = [s for s in router.candidates(MODEL_ID) if s.shard_id == shard_id]
    return router.not_alive_because(shard, router.now())


def beat_for_a_minute(engine, offset_s: float) -> tuple[str, list[str | None]]:
    """A host whose clock is `offset_s` off the broker's (and the orchestrator's) beats every 2 s for a minute; what
    routing says of it just before each next beat."""
    log, projection = LogBuilder(), ReadModelProjection(max_clock_skew_s=SKEW_S)
    shard = advertised(0, 7, "skewed", t=100.0 + offset_s, ttl_s=600.0)
    apply_all(engine, [stored_by_broker(log, shard, broker_s=100.0)], projection)
    verdicts = []
    for beat in range(30):
        broker_s = 100.0 + beat * BEAT_S
        beat_event = heartbeat(shard.shard_id, t=broker_s + offset_s, node="skewed")
        apply_all(engine, [stored_by_broker(log, beat_event, broker_s=broker_s)], projection)
        verdicts.append(not_alive_because(engine, shard.shard_id, broker_s + BEAT_S - 0.01))
    return shard.shard_id, verdicts


@pytest.mark.parametrize("offset_s", [0.0, -SKEW_S + 1, SKEW_S - 1, -20.0])
def test_a_host_whose_clock_is_within_the_limit_never_looks_dead(engine, offset_s):
    _, verdicts = beat_for_a_minute(engine, offset_s)
    assert verdicts == [None] * len(verdicts)


def test_a_host_whose_clock_is_far_behind_is_left_out(engine):
    _, verdicts = beat_for_a_minute(engine, -300.0)
    assert all(verdict is not None and "not heard from" in verdict for verdict in verdicts)


def test_a_host_ahead_within_the_limit_is_not_heard_in_the_future(engine):
    """Its rows hold the broker's instants, so ages on dashboards are never negative."""
    shard_id, _ = beat_for_a_minute(engine, SKEW_S - 1)
    with engine.connect() as connection:
        (last_seen,) = connection.exec_driver_sql("SELECT last_seen FROM shard_health WHERE shard_id = ?",
                                                  (shard_id,)).one()
    assert last_seen <= epoch_s(at(100.0 + 29 * BEAT_S))


SKEW_LOGGER = "hearth.events.clock_skew"


def skew_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == SKEW_LOGGER]


def test_a_host_far_behind_is_named_once_with_its_offset_not_at_every_heartbeat(engine, caplog):
    with caplog.at_level(logging.WARNING, logger=SKEW_LOGGER):
        beat_for_a_minute(engine, -300.0)
    assert len(skew_lines(caplog)) == 1, skew_lines(caplog)
    assert skew_lines(caplog)[0].startswith("skewed's clock is about 300 s behind the broker's clock")


def test_a_host_within_the_limit_is_not_named(engine, caplog):
    with caplog.at_level(logging.WARNING, logger=SKEW_LOGGER):
        beat_for_a_minute(engine, -SKEW_S + 1)
    assert skew_lines(caplog) == []


def test_a_host_far_ahead_has_its_events_rejected_and_is_named_once(tmp_path, caplog):
    """Signed events from a host whose clock is 5 min ahead: every one rejected (future_dated), one line naming it."""
    engine = migrated_engine(tmp_path / "signed.db")
    key = MemberKey.generate()
    roster = new_roster("t").with_member(new_member("ahead", "shard", key.public_key))
    projection = ReadModelProjection(verifier=EventVerifier(roster, max_clock_skew_s=SKEW_S))
    log = LogBuilder()
    shard = advertised(0, 7, "ahead", t=400.0, control_subject=shard_control_subject(
        "ahead", shard_id_for(MODEL_ID, 0, 7, "ahead")))
    messages = [stored_by_broker(log, sign_event(shard, key), broker_s=100.0)]
    messages += [stored_by_broker(log, sign_event(heartbeat(shard.shard_id, t=400.0 + n, node="ahead"), key),
                                  broker_s=100.0 + n) for n in range(20)]
    rejections: list[Rejection] = []
    try:
        with caplog.at_level(logging.WARNING, logger=SKEW_LOGGER), Session(engine) as session, session.begin():
            projection.apply_many(session, messages, rejections=rejections)
    finally:
        engine.dispose()
    assert {rejection.reason for rejection in rejections} == {"future_dated"} and len(rejections) == 21
    assert len(skew_lines(caplog)) == 1, skew_lines(caplog)
    assert skew_lines(caplog)[0].startswith("ahead's clock is about 300 s ahead of the broker's clock")

"""Shard reputation in the read model: the integrity.* handlers (verified work, quarantine, disputes, clearing),
replays and rebuilds give the same rows, the router never plans a quarantined shard, and migration 0006 upgrades
a database that already holds rows."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.orm import Session, sessionmaker

from hearth.readmodels.db import open_engine, upgrade_database
from hearth.readmodels.batch_rows import epoch_s
from hearth.readmodels.queries import shard_reputations, shards_of_model
from hearth.protocol.subjects import node_of_shard
from hearth.readmodels.reputation import ReputationLog
from hearth.readmodels.tables import IntegrityEvidence, ShardReputation
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from tests.readmodel_helpers import (
    MODEL_ID,
    WEIGHTS_SHA,
    LogBuilder,
    advertised,
    apply_all,
    at,
    constructed,
    dump_rows,
    heartbeat,
    migrated_engine,
    synthetic_events,
)
from tests.reputation_events import cleared, confirmed, disputed, verified

A, B, C = (advertised(0, 3, node).shard_id for node in ("node-a", "node-b", "node-c"))
HIGH = advertised(4, 7, "node-h").shard_id


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    yield engine
    engine.dispose()


def reputation(engine, shard_id: str) -> ShardReputation | None:
    with Session(engine) as session:
        return session.get(ShardReputation, shard_id)


def evidence(engine, shard_id: str) -> list[IntegrityEvidence]:
    with Session(engine) as session:
        return list(session.query(IntegrityEvidence).filter_by(shard_id=shard_id).order_by(IntegrityEvidence.event_id))


def test_verified_work_adds_up_per_shard(engine):
    log = LogBuilder()
    apply_all(engine, [log.stored(verified("p1", {A: (2, 40), HIGH: (1, 17)})),
                       log.stored(verified("p2", {A: (3, 9)}, t=5.0))])
    row = reputation(engine, A)
    assert (row.checks, row.verified_positions, row.mismatches, row.disputes) == (5, 49, 0, 0)
    assert (row.status, row.status_since, row.node_id, row.updated_at) == ("ok", None, "node-a", epoch_s(at(5.0)))
    assert (reputation(engine, HIGH).checks, reputation(engine, HIGH).verified_positions) == (1, 17)


def test_a_confirmed_mismatch_quarantines_the_refuted_shard_and_not_its_witnesses(engine):
    log = LogBuilder()
    mismatch = confirmed("p1", A, [B, C], t=4.0)
    apply_all(engine, [log.stored(verified("p0", {A: (1, 8)})), log.stored(mismatch)])
    row = reputation(engine, A)
    assert (row.status, row.mismatches, row.checks) == ("quarantined", 1, 1)
    assert (row.status_since, row.status_event_id) == (epoch_s(at(4.0)), mismatch.event_id)
    assert "decode position 17" in row.status_reason and "0.42 > tolerance 0.002" in row.status_reason
    assert B in row.status_reason and "pipeline p1" in row.status_reason
    assert reputation(engine, B) is None and reputation(engine, C) is None
    [found] = evidence(engine, A)
    assert (found.kind, found.pipeline_id, json.loads(found.witnesses)) == ("confirmed", "p1", [B, C])
    assert (found.layer_lo, found.layer_hi, found.position, found.step_kind) == (0, 3, 17, "decode")
    assert (found.relative_error, found.tolerance, found.reported_by) == (0.42, 0.002, "hub")


def test_a_second_mismatch_counts_but_keeps_the_first_as_the_reason(engine):
    log = LogBuilder()
    first, second = confirmed("p1", A, [B, C], t=4.0), confirmed("p2", A, [B, C], t=6.0, position=3)
    apply_all(engine, [log.stored(first), log.stored(second)])
    row = reputation(engine, A)
    assert (row.mismatches, row.status_event_id, row.status_since) == (2, first.event_id, epoch_s(at(4.0)))
    assert len(evidence(engine, A)) == 2


def test_a_republished_mismatch_counts_once():
    log = ReputationLog()
    mismatch = confirmed("p1", A, [B, C])
    log.apply(mismatch)
    log.apply(mismatch)  # the same event_id again, after the broker's de-duplication window
    assert log.reputation(A)["mismatches"] == 1 and len(log.evidence(A)) == 1


def test_a_dispute_counts_against_both_and_quarantines_nobody(engine):
    log = LogBuilder()
    apply_all(engine, [log.stored(disputed("p1", [A, B]))])
    for shard, other in ((A, B), (B, A)):
        row = reputation(engine, shard)
        assert (row.status, row.disputes, row.mismatches) == ("ok", 1, 0)
        [found] = evidence(engine, shard)
        assert (found.kind, json.loads(found.witnesses)) == ("disputed", [other])


def test_a_steward_clears_a_quarantine_and_counts_stay(engine):
    log = LogBuilder()
    clearing = cleared(A, t=10.0)
    apply_all(engine, [log.stored(confirmed("p1", A, [B, C], t=4.0)), log.stored(clearing)])
    row = reputation(engine, A)
    assert (row.status, row.status_since, row.status_event_id) == ("ok", epoch_s(at(10.0)), clearing.event_id)
    assert (row.status_reason, row.mismatches) == ("replaced the faulty GPU", 1)
    apply_all(engine, [log.stored(confirmed("p2", A, [B, C], t=12.0))])
    assert reputation(engine, A).status == "quarantined"  # a new confirmed mismatch quarantines again


def test_clearing_a_shard_that_is_not_quarantined_or_an_older_clearing_changes_nothing():
    log = ReputationLog()
    log.apply(cleared(A, t=1.0))
    assert log.reputation(A) is None
    log.apply(confirmed("p1", A, [B, C], t=20.0))
    log.apply(cleared(A, t=5.0))  # older than the quarantine: a re-published old clearing
    assert log.reputation(A)["status"] == "quarantined"
    log.apply(verified("p2", {B: (1, 1)}))
    log.apply(cleared(B, t=30.0))
    assert log.reputation(B)["status"] == "ok" and log.reputation(B)["status_event_id"] is None


def test_node_of_shard():
    assert node_of_shard(A) == "node-a"
    assert node_of_shard("no-node-here") is None


def reputation_mix() -> list:
    """The synthetic mesh with verification outcomes interleaved: checks, a dispute, a quarantine, a clearing."""
    events = synthetic_events(pipelines=12, heartbeats_per_shard=3)
    ids = [event.shard_id for event in events if event.type == "shard.advertised"]
    outcomes = [verified("p0-1", {ids[0]: (2, 30), ids[1]: (2, 30)}, t=2.0),
                disputed("p0-2", [ids[0], ids[2]], t=2.5),
                confirmed("p0-3", ids[1], [ids[3], ids[0]], t=3.0),
                verified("p0-4", {ids[2]: (1, 5)}, t=3.5),
                cleared(ids[1], t=4.0),
                confirmed("p0-5", ids[3], [ids[1], ids[0]], t=4.5)]
    return sorted(events + outcomes, key=lambda event: event.occurred_at)


def test_rebuilding_in_other_batches_gives_the_same_rows(tmp_path):
    events = reputation_mix()
    dumps = []
    for name, batches in (("one", [events]), ("each", [[e] for e in events]), ("thirds", [events[:9], events[9:]])):
        engine = migrated_engine(tmp_path / f"{name}.db")
        log = LogBuilder()
        stored = [log.stored(event) for event in events]
        start = 0
        for batch in batches:
            apply_all(engine, stored[start:start + len(batch)])
            start += len(batch)
        apply_all(engine, stored)  # a replay over an up-to-date database changes nothing
        dumps.append(dump_rows(engine))
        engine.dispose()
    assert dumps[0] == dumps[1] == dumps[2]
    assert len(dumps[0]["shard_reputation"]) == 4 and len(dumps[0]["integrity_evidence"]) == 4


def test_the_log_view_and_the_read_model_agree(engine):
    events = reputation_mix()
    log = LogBuilder()
    apply_all(engine, [log.stored(event) for event in events])
    memory = ReputationLog()
    for event in events:
        memory.apply(event)
    with Session(engine) as session:
        for row in shard_reputations(session):
            as_dict = {column: getattr(row, column) for column in memory.reputation(row.shard_id)}
            assert as_dict == memory.reputation(row.shard_id)


def test_the_listing_puts_quarantined_shards_first(engine):
    log = LogBuilder()
    apply_all(engine, [log.stored(verified("p1", {B: (4, 4)})), log.stored(disputed("p2", [B, C])),
                       log.stored(confirmed("p3", A, [B, C]))])
    with Session(engine) as session:
        assert [row.shard_id for row in shard_reputations(session)] == [A, B, C]


# ---- routing ---------------------------------------------------------------------------------------------------


def routed_nodes(engine, now: float) -> list[str]:
    router = ShardRouter(sessionmaker(engine), health_timeout_s=30.0, allow_self_as_shard=False,
                         self_node_id="hub", clock=lambda: now)
    return [hop.node_id for hop in router.pick(MODEL_ID, WEIGHTS_SHA)]


def test_the_router_never_plans_a_quarantined_shard_and_plans_it_again_once_cleared(engine):
    log = LogBuilder()
    fast, slow = advertised(0, 7, "fast", total=8), advertised(0, 7, "slow", total=8, hop_weight=5.0)
    apply_all(engine, [log.stored(e) for e in (fast, slow, heartbeat(fast.shard_id, node="fast", decode_step_ms=1.0),
                                                heartbeat(slow.shard_id, node="slow", decode_step_ms=50.0))])
    now = epoch_s(at(5.0))
    assert routed_nodes(engine, now) == ["fast"]
    apply_all(engine, [log.stored(confirmed("p1", fast.shard_id, [slow.shard_id, "w:0-7@x"], t=3.0))])
    assert routed_nodes(engine, now) == ["slow"]
    with Session(engine) as session:
        assert {s.shard_id: s.quarantined for s in shards_of_model(session, MODEL_ID)} == {
            fast.shard_id: True, slow.shard_id: False}
    apply_all(engine, [log.stored(confirmed("p2", slow.shard_id, [fast.shard_id, "w:0-7@x"], t=3.5))])
    with pytest.raises(RoutingError) as refused:
        routed_nodes(engine, now)
    assert refused.value.code == "shard_unavailable"
    apply_all(engine, [log.stored(cleared(fast.shard_id, t=4.0))])
    assert routed_nodes(engine, now) == ["fast"]


# ---- migration -------------------------------------------------------------------------------------------------


def test_migration_0006_upgrades_a_database_that_holds_rows(tmp_path):
    path = tmp_path / "old.db"
    upgrade_database(path, "0005")
    old = open_engine(path)
    with old.begin() as connection:
        assert "shard_reputation" not in inspect(connection).get_table_names()
        connection.execute(text(
            "INSERT INTO shards (shard_id, model_id, weights_sha256, node_id, layer_lo, layer_hi, total_layers, "
            "dtype, quantization, memory_required_mb, max_concurrent_streams, control_subject, hop_weight, ttl_s, "
            "status, advertised_at, expires_at) VALUES (:id, :model, :sha, 'node-a', 0, 7, 8, 'float32', 'none', "
            "1.0, 2, 'hearth.ctl.node-a.x', 1.0, 120.0, 'advertised', 0, 120)"),
            dict(id=A, model=MODEL_ID, sha=WEIGHTS_SHA))
    old.dispose()
    upgrade_database(path)
    engine = open_engine(path)
    try:
        with Session(engine) as session:
            [shard] = shards_of_model(session, MODEL_ID)
            assert (shard.shard_id, shard.quarantined) == (A, False)
        apply_all(engine, [LogBuilder().stored(confirmed("p1", A, [B, C])),
                           LogBuilder().stored(constructed("p9", [A], t=5.0))])
        with Session(engine) as session:
            assert shards_of_model(session, MODEL_ID)[0].quarantined
    finally:
        engine.dispose()

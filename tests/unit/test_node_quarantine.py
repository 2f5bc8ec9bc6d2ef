"""A quarantine holds the node: while any shard of a node is quarantined, routing and model discovery leave out
every shard of that node (another layer range, another scheme), saying which shard holds it; a steward's clearing
frees the node once none of its shards is quarantined."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from sqlalchemy.orm import Session, sessionmaker

from hearth.protocol.quarantine import node_quarantine_reason, quarantined_nodes
from hearth.readmodels.batch_rows import epoch_s
from hearth.readmodels.queries import shards_of_model
from hearth.services.orchestrator.discovery import describe_models
from hearth.services.orchestrator.router import RoutingError, ShardRouter
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
from tests.reputation_events import cleared, confirmed

LIAR, HONEST = "liar", "honest"


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    yield engine
    engine.dispose()


def router(now: float, engine) -> ShardRouter:
    return ShardRouter(sessionmaker(engine), health_timeout_s=30.0, allow_self_as_shard=False,
                       self_node_id="hub", clock=lambda: now)


def serve(engine, log: LogBuilder, *shards) -> None:
    apply_all(engine, [log.stored(event) for shard in shards
                       for event in (shard, heartbeat(shard.shard_id, node=shard.node_id, decode_step_ms=1.0))])


@pytest.mark.parametrize("restarted", [dict(hi=6), dict(hi=7, quantization="int8")],
                         ids=["another range", "another scheme"])
def test_a_caught_shard_restarted_under_a_new_id_is_not_routed(engine, restarted):
    log = LogBuilder()
    caught = advertised(0, 7, LIAR, total=8)
    tail = advertised(7, 7, HONEST, total=8)
    serve(engine, log, caught, tail)
    apply_all(engine, [log.stored(confirmed("p1", caught.shard_id, ["w:0-7@x", "w:0-7@y"], t=3.0))])
    # The liar comes back as a new shard id: other layers, or the same layers in another scheme.
    again = advertised(0, restarted["hi"], LIAR, total=8, t=4.0, quantization=restarted.get("quantization", "none"))
    serve(engine, log, again)
    now = epoch_s(at(5.0))
    with pytest.raises(RoutingError) as refused:
        router(now, engine).pick(MODEL_ID, WEIGHTS_SHA, quantization=restarted.get("quantization"))
    assert f"{again.shard_id}: node {LIAR} quarantined (shard {caught.shard_id} mismatched)" in refused.value.message
    with Session(engine) as session:
        rows = {s.shard_id: s for s in shards_of_model(session, MODEL_ID)}
    assert rows[again.shard_id].node_quarantined_by == caught.shard_id and not rows[again.shard_id].quarantined
    assert rows[tail.shard_id].node_quarantined_by is None
    assert router(now, engine).not_alive_because(rows[again.shard_id], now) == \
        f"node {LIAR} quarantined (shard {caught.shard_id} mismatched)"
    assert router(now, engine).not_alive_because(rows[caught.shard_id], now) == "quarantined"


def test_the_node_is_free_again_once_none_of_its_shards_is_quarantined(engine):
    log = LogBuilder()
    first, second = advertised(0, 7, LIAR, total=8), advertised(0, 7, LIAR, total=8, quantization="int8")
    other = advertised(0, 7, LIAR, total=8, quantization="int4/g64")
    serve(engine, log, first, second, other)
    apply_all(engine, [log.stored(confirmed("p1", first.shard_id, ["w:0-7@x", "w:0-7@y"], t=3.0)),
                       log.stored(confirmed("p2", second.shard_id, ["w:0-7@x", "w:0-7@y"], t=3.0))])
    now = epoch_s(at(5.0))
    with pytest.raises(RoutingError):
        router(now, engine).pick(MODEL_ID, WEIGHTS_SHA)
    apply_all(engine, [log.stored(cleared(first.shard_id, t=4.0))])
    with Session(engine) as session:
        rows = {s.shard_id: s for s in shards_of_model(session, MODEL_ID)}
    # One of its shards is still quarantined: the node stays held, the cleared shard included.
    assert rows[first.shard_id].node_quarantined_by == second.shard_id
    assert rows[other.shard_id].node_quarantined_by == second.shard_id
    with pytest.raises(RoutingError):
        router(now, engine).pick(MODEL_ID, WEIGHTS_SHA)
    apply_all(engine, [log.stored(cleared(second.shard_id, t=4.5, clearing_id="clear-0100"))])
    assert [hop.shard_id for hop in router(now, engine).pick(MODEL_ID, WEIGHTS_SHA)] == [first.shard_id]


def test_model_discovery_does_not_count_a_held_nodes_shards(engine):
    log = LogBuilder()
    caught = advertised(0, 7, LIAR, total=8)
    serve(engine, log, caught)
    apply_all(engine, [log.stored(confirmed("p1", caught.shard_id, ["w:0-7@x", "w:0-7@y"], t=3.0))])
    serve(engine, log, advertised(0, 7, LIAR, total=8, t=4.0, quantization="int8"))
    catalog = SimpleNamespace(local_model_at_hand=lambda: None, path_of_id=lambda model_id, local: None)
    reply = asyncio.run(describe_models(router(epoch_s(at(5.0)), engine), catalog))
    assert reply.models == []


def test_the_nodes_quarantined_shards_hold_each_named_by_its_first_quarantined_shard():
    assert quarantined_nodes(["m:4-7@a", "m:0-3@a", "m:0-3+int8@b", "no-node-here"]) == {
        "a": "m:0-3@a", "b": "m:0-3+int8@b"}
    assert node_quarantine_reason("a", "m:0-3@a") == "node a quarantined (shard m:0-3@a mismatched)"

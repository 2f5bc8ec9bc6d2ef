"""The in-process Projector as the orchestrator uses it: publish, wait for the position, route on the rows (read
again only once the projector applied something)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hearth.events.models import ShardWithdrawn
from hearth.events.publish import publish_event
from hearth.events.streams import SHARDS_STREAM, ensure_streams
from hearth.readmodels.runner import Projector
from hearth.services.broker.connection import connect_nats
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from hearth.readmodels.catch_up import read_model_caught_up
from tests.readmodel_helpers import MODEL_ID, WEIGHTS_SHA, advertised, at

pytestmark = pytest.mark.integration


@pytest.fixture
async def routed(nats_url, tmp_path):
    """A started in-process projector over the test broker's streams, and the JetStream context to publish with."""
    nc = await connect_nats(nats_url, name="test-orchestrator")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        async with Projector(tmp_path / "routing.db", js) as projector:
            yield SimpleNamespace(js=js, projector=projector)
    finally:
        await nc.close()


async def _two_halves_advertised(js, projector: Projector):
    """Shards "a" (layers 0-3) and "b" (4-7) advertised, and the read model past them."""
    low, high = advertised(0, 3, "a"), advertised(4, 7, "b")
    for event in (low, high):
        ack = await publish_event(js, event)
    await projector.wait_for_position(ack.stream, ack.seq, timeout_s=10)
    return low, high


async def _withdrawn(js, projector: Projector, shard) -> None:
    ack = await publish_event(js, ShardWithdrawn(shard_id=shard.shard_id, reason="shutdown", node_id=shard.node_id,
                                                 occurred_at=at(1)))
    await projector.wait_for_position(ack.stream, ack.seq, timeout_s=10)


async def test_wait_for_position_then_route_on_what_was_just_published(routed):
    projector = routed.projector
    low, high = await _two_halves_advertised(routed.js, projector)
    # b leaves (routing ignores heartbeat capacity figures: they are seconds old)
    await _withdrawn(routed.js, projector, high)

    router = ShardRouter(projector.session_factory, health_timeout_s=3600, allow_self_as_shard=False,
                         self_node_id="hub", clock=lambda: low.occurred_at.timestamp() + 2,
                         read_model_version=lambda: projector.batches_total)
    with pytest.raises(RoutingError) as error:
        router.pick(MODEL_ID, WEIGHTS_SHA)
    assert (error.value.code, error.value.uncovered_layers) == ("shard_unavailable", (4, 5, 6, 7))

    ack = await publish_event(routed.js, advertised(4, 7, "b", t=2))
    await projector.wait_for_position(ack.stream, ack.seq, timeout_s=10)
    assert [hop.shard_id for hop in router.pick(MODEL_ID, WEIGHTS_SHA)] == [low.shard_id, high.shard_id]
    assert projector.positions[SHARDS_STREAM] == ack.seq

    with pytest.raises(TimeoutError):
        await projector.wait_for_position(SHARDS_STREAM, ack.seq + 1, timeout_s=0.3)


async def test_an_orchestrator_waits_for_its_read_model_to_reach_the_log_before_answering(nats_url, tmp_path):
    nc = await connect_nats(nats_url, name="test-orchestrator")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        for index in range(40):  # a log written before this orchestrator (re)started
            last = await publish_event(js, advertised(0, 7, f"n{index}", t=float(index)))
        projector = Projector(tmp_path / "restarted.db", js)
        # Not reading the log yet: the wait gives up within its bound instead of hanging the start.
        assert not await read_model_caught_up(projector, timeout_s=0.3, going_on="on")
        async with projector:
            assert await read_model_caught_up(projector, timeout_s=10, going_on="on")
            assert projector.positions[SHARDS_STREAM] >= last.seq
            router = ShardRouter(projector.session_factory, health_timeout_s=3600, allow_self_as_shard=False,
                                 self_node_id="orch", clock=lambda: at(40).timestamp())
            assert len(router.candidates(MODEL_ID)) == 40
    finally:
        await nc.close()


async def test_a_router_reads_the_rows_again_only_once_the_projector_applied_something(routed):
    projector = routed.projector
    low, high = await _two_halves_advertised(routed.js, projector)
    queries = []

    def counted_session():
        queries.append(1)
        return projector.session_factory()

    router = ShardRouter(counted_session, health_timeout_s=3600, allow_self_as_shard=False,
                         self_node_id="hub", clock=lambda: low.occurred_at.timestamp() + 2,
                         read_model_version=lambda: projector.batches_total)
    chain = [hop.shard_id for hop in router.pick(MODEL_ID, WEIGHTS_SHA)]
    assert chain == [low.shard_id, high.shard_id]
    assert [hop.shard_id for hop in router.pick(MODEL_ID, WEIGHTS_SHA)] == chain
    assert len(router.candidates(MODEL_ID)) == 2 and len(queries) == 1

    await _withdrawn(routed.js, projector, high)
    with pytest.raises(RoutingError):
        router.pick(MODEL_ID, WEIGHTS_SHA)
    assert len(queries) == 2

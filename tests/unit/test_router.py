"""Unit tests of ShardRouter (docs/design.md §5) on an Alembic-created read model filled by the projection."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import sessionmaker

from events.models import ShardWithdrawn
from readmodels.projection import epoch_s
from services.orchestrator.capacity import ShardLoad
from services.orchestrator.router import Hop, RoutingError, ShardRouter, format_layer_ranges
from tests.readmodel_helpers import (
    MODEL_ID,
    T0,
    WEIGHTS_SHA,
    LogBuilder,
    advertised,
    apply_all,
    at,
    heartbeat,
    migrated_engine,
)

health_timeout_s = 30.0
OTHER_SHA = "cd" * 32


class Mesh:
    """A read model plus a router whose clock the test moves."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.log = LogBuilder()
        self.now = epoch_s(T0) + 5.0

    def add(self, lo: int, hi: int, node: str, *, queue_depth: int = 0, active_streams: int = 0,
            heartbeat_t: float | None = 2.0, **advert_fields) -> str:
        shard = advertised(lo, hi, node, **advert_fields)
        events = [shard]
        if heartbeat_t is not None:
            events.append(heartbeat(shard.shard_id, t=heartbeat_t, queue_depth=queue_depth,
                                    active_streams=active_streams, node=node))
        apply_all(self.engine, [self.log.stored(e) for e in events])
        return shard.shard_id

    def router(self, *, allow_self: bool = False, self_node: str = "hub", max_hops: int | None = None):
        return ShardRouter(sessionmaker(self.engine), health_timeout_s=health_timeout_s,
                           allow_self_as_shard=allow_self, self_node_id=self_node,
                           clock=lambda: self.now, max_hops=max_hops)

    def pick(self, *, exclude=(), weights=WEIGHTS_SHA, **router_kwargs) -> list[tuple[str, int, int]]:
        hops = self.router(**router_kwargs).pick(MODEL_ID, weights, exclude=exclude)
        return [(hop.shard_id.split("@")[1], hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops]


@pytest.fixture
def mesh(tmp_path):
    engine = migrated_engine(tmp_path / "router.db")
    yield Mesh(engine)
    engine.dispose()


def test_two_shards_cover_the_model_and_hops_carry_control_subjects(mesh):
    a = mesh.add(0, 3, "a")
    b = mesh.add(4, 7, "b")
    hops = mesh.router().pick(MODEL_ID, WEIGHTS_SHA)
    assert hops == [Hop(a, "hearth.ctl.a.x0", "a", 0, 3), Hop(b, "hearth.ctl.b.x4", "b", 4, 7)]


def test_lowest_queue_depth_then_hop_weight_then_longest_reach(mesh):
    mesh.add(0, 7, "busy", queue_depth=2)
    mesh.add(0, 3, "idle-far", hop_weight=3.0)
    mesh.add(0, 3, "idle-near")
    mesh.add(4, 5, "short")
    mesh.add(4, 7, "long")
    assert mesh.pick() == [("idle-near", 0, 3), ("long", 4, 7)]


def test_partial_use_from_the_first_needed_layer(mesh):
    mesh.add(0, 3, "a")
    mesh.add(2, 7, "b")
    mesh.add(4, 5, "c", queue_depth=1)
    assert mesh.pick() == [("a", 0, 3), ("b", 4, 7)]


def test_unusable_shards_are_skipped(mesh):
    mesh.add(0, 7, "withdrawn")
    apply_all(mesh.engine, [mesh.log.stored(ShardWithdrawn(
        shard_id=f"{MODEL_ID}:0-7@withdrawn", reason="shutdown", node_id="withdrawn", occurred_at=at(3)))])
    mesh.add(0, 7, "expiring", ttl_s=4.0)
    mesh.add(0, 7, "stale", heartbeat_t=-40.0, t=-40.0)
    mesh.add(0, 7, "excluded")
    mesh.add(0, 7, "fine", queue_depth=5)
    assert mesh.pick(exclude=[f"{MODEL_ID}:0-7@excluded"]) == [("fine", 0, 7)]


def test_a_heartbeat_saying_full_is_stale_and_live_load_decides(mesh):
    full = mesh.add(0, 7, "reported-full", active_streams=2)  # max_concurrent_streams is 2
    other = mesh.add(0, 7, "other", queue_depth=3)
    router = mesh.router()
    load = ShardLoad(retry_s=60.0)

    def pick() -> list[str]:
        hops = router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, now=mesh.now, load=load)
        return [hop.shard_id for hop in hops]

    assert pick() == [full]  # the heartbeat's active_streams is not trusted
    load.hold([full])
    assert pick() == [other]  # replicas share the load: fewest streams held by us first
    load.hold([other])
    load.refused(full)  # another orchestrator fills it
    assert pick() == [other]
    load.hold([other])  # two held: `other` is full too
    with pytest.raises(RoutingError):
        pick()
    load.release([full])  # one of our streams on it ended: room again
    assert pick() == [full]


def test_freshly_advertised_shard_is_routable_before_its_first_heartbeat(mesh):
    mesh.add(0, 7, "new", heartbeat_t=None)
    assert mesh.pick() == [("new", 0, 7)]
    mesh.now += health_timeout_s + 1
    with pytest.raises(RoutingError) as error:
        mesh.pick()
    assert error.value.code == "shard_unavailable"


def test_self_node_is_not_hop_zero_unless_allowed(mesh):
    mesh.add(0, 7, "hub")
    mesh.add(0, 3, "a", queue_depth=4)
    mesh.add(4, 7, "hub2")
    # The idle self shard would win on cost; it may still serve later layers.
    assert mesh.pick(self_node="hub") == [("a", 0, 3), ("hub", 4, 7)]
    assert mesh.pick(self_node="hub", allow_self=True) == [("hub", 0, 7)]


def test_only_self_holding_layer_zero_is_unavailable(mesh):
    mesh.add(0, 3, "hub")
    mesh.add(2, 7, "a")
    with pytest.raises(RoutingError) as error:
        mesh.pick(self_node="hub")
    assert error.value.code == "shard_unavailable"
    assert error.value.uncovered_layers == (0, 1, 2, 3)
    assert "allow_self_as_shard" in str(error.value)


def test_hole_in_the_layers_is_shard_unavailable_naming_the_layers(mesh):
    mesh.add(0, 3, "a")
    mesh.add(6, 7, "c")
    with pytest.raises(RoutingError) as error:
        mesh.pick()
    assert error.value.code == "shard_unavailable"
    assert error.value.uncovered_layers == (4, 5)
    assert "layers 4-5" in str(error.value)


def test_other_weights_are_weights_mismatch(mesh):
    mesh.add(0, 3, "a")
    mesh.add(4, 7, "b", weights_sha256=OTHER_SHA)
    with pytest.raises(RoutingError) as error:
        mesh.pick()
    assert error.value.code == "weights_mismatch"
    assert "layers 4-7" in str(error.value)
    with pytest.raises(RoutingError) as error:
        mesh.pick(weights=OTHER_SHA)
    assert (error.value.code, error.value.uncovered_layers) == ("weights_mismatch", (0, 1, 2, 3))


def test_no_shard_at_all_is_shard_unavailable(mesh):
    with pytest.raises(RoutingError) as error:
        mesh.pick()
    assert error.value.code == "shard_unavailable"


def test_max_hops_limits_the_pipeline_length(mesh):
    mesh.add(0, 3, "a")
    mesh.add(4, 7, "b")
    assert len(mesh.pick(max_hops=2)) == 2
    with pytest.raises(RoutingError) as error:
        mesh.pick(max_hops=1)
    assert error.value.code == "shard_unavailable"


def test_format_layer_ranges():
    assert format_layer_ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"

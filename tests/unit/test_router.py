"""Unit tests of ShardRouter (docs/design.md §5) on an Alembic-created read model filled by the projection."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.orm import sessionmaker

from hearth.events.models import ShardWithdrawn
from hearth.events.signing import roster_recheck_interval_s
from hearth.readmodels.batch_rows import epoch_s
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import node_membership
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.router import Hop, RoutingError, ShardRouter, format_layer_ranges
from hearth.trust.community import Community
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
            heartbeat_t: float | None = 2.0, decode_step_ms: float | None = None, **advert_fields) -> str:
        shard = advertised(lo, hi, node, **advert_fields)
        events = [shard]
        if heartbeat_t is not None:
            events.append(heartbeat(shard.shard_id, t=heartbeat_t, queue_depth=queue_depth,
                                    active_streams=active_streams, node=node, decode_step_ms=decode_step_ms))
        apply_all(self.engine, [self.log.stored(e) for e in events])
        return shard.shard_id

    def router(self, *, allow_self: bool = False, self_node: str = "hub", max_hops: int | None = None,
               node_membership=None):
        return ShardRouter(sessionmaker(self.engine), health_timeout_s=health_timeout_s,
                           allow_self_as_shard=allow_self, self_node_id=self_node,
                           clock=lambda: self.now, max_hops=max_hops, node_membership=node_membership)

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


def test_a_removed_members_shards_are_left_out_at_once_and_the_refusal_says_why(mesh, tmp_path):
    community = Community.init(tmp_path / "community", "router-test")
    for name in ("a", "b"):
        community.add(name, "shard")
    settings = HearthSettings.model_validate({"nats": {"creds_file": str(community.directory / "keys" / "a.nk")}})
    membership = node_membership(settings)
    mesh.add(0, 7, "a")
    mesh.add(0, 3, "b")
    mesh.add(0, 7, "stranger")
    router = mesh.router(node_membership=membership)
    assert mesh.pick(node_membership=membership) == [("a", 0, 7)]
    community.remove("a")
    time.sleep(roster_recheck_interval_s)  # the roster file is looked at again after this
    with pytest.raises(RoutingError) as refused:
        router.pick(MODEL_ID, WEIGHTS_SHA)
    assert "its member was removed from the community" in str(refused.value)
    assert "not a member of the community" in str(refused.value)
    assert node_membership(HearthSettings()) is None  # an open mesh routes by the read model alone
    # A member added since the roster file was last looked at is routed to at once.
    assert membership("newcomer") == "not a member of the community"
    community.add("newcomer", "shard")
    assert membership("newcomer") is None


def test_a_heartbeat_saying_full_is_stale_and_live_load_decides(mesh):
    full = mesh.add(0, 7, "a-reported-full", active_streams=2)  # max_concurrent_streams is 2
    other = mesh.add(0, 7, "b-other")
    router = mesh.router()
    load = ShardLoad(retry_s=60.0)

    def pick() -> list[str]:
        hops = router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, now=mesh.now, load=load)
        return [hop.shard_id for hop in hops]

    assert pick() == [full]  # the heartbeat's active_streams is not trusted
    load.hold([full])
    assert pick() == [other]  # replicas share the load: a stream we hold slows a shard's every token
    load.hold([other])
    load.refused(full)  # another orchestrator fills it
    assert pick() == [other]
    load.hold([other])  # two held: `other` is full too
    with pytest.raises(RoutingError):
        pick()
    load.release([full])  # one of our streams on it ended: room again
    assert pick() == [full]


def plan_with(mesh, load: ShardLoad) -> list[tuple[str, int, int]]:
    router = mesh.router()
    hops = router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, now=mesh.now, load=load)
    return [(hop.shard_id.split("@")[1], hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops]


def test_the_faster_replica_wins_once_measured_and_an_unmeasured_one_is_tried(mesh):
    mesh.add(0, 7, "a-slow", decode_step_ms=80.0)
    mesh.add(0, 7, "b-fast", decode_step_ms=8.0)
    assert plan_with(mesh, ShardLoad(retry_s=1.0)) == [("b-fast", 0, 7)]
    # A newcomer is assumed as fast as the fastest measured shard and wins the tie: it gets measured.
    mesh.add(0, 7, "c-new")
    assert plan_with(mesh, ShardLoad(retry_s=1.0)) == [("c-new", 0, 7)]


def test_a_declared_weight_below_one_counts_only_until_measured_and_round_trips_decide(mesh):
    mesh.add(0, 7, "claims-near", hop_weight=0.5)
    mesh.add(0, 7, "honest", decode_step_ms=8.0)
    load = ShardLoad(retry_s=1.0)
    load.observe_round_trip(f"{MODEL_ID}:0-7@honest", 0.002)
    assert plan_with(mesh, load) == [("claims-near", 0, 7)]  # the prior: as fast as the replica, and nearer
    # Measured as fast, but farther: the claim no longer counts.
    mesh.add(0, 7, "claims-near", hop_weight=0.5, decode_step_ms=8.0, t=3.0, heartbeat_t=3.0)
    load.observe_round_trip(f"{MODEL_ID}:0-7@claims-near", 0.040)
    assert plan_with(mesh, load) == [("honest", 0, 7)]


def test_a_shard_that_stays_unmeasured_cannot_buy_every_plan_with_a_tiny_weight(mesh):
    """A shard that never reports a step time stays unmeasured: before, its declared weight of 0.001 won every plan,
    against a chain predicted 2.4x as fast; now its weight favours it at most 2x."""
    mesh.add(0, 7, "sly", hop_weight=0.001)
    mesh.add(0, 7, "replica", decode_step_ms=12.0)  # the sly shard is predicted from it: 13 ms a token
    mesh.add(0, 4, "front", decode_step_ms=2.0)  # with "back": 5.5 ms a token
    mesh.add(5, 7, "back", decode_step_ms=1.5)
    load = ShardLoad(retry_s=1.0)
    assert plan_with(mesh, load) == [("front", 0, 4), ("back", 5, 7)]


def test_a_weight_above_one_is_always_honoured(mesh):
    mesh.add(0, 7, "primary", decode_step_ms=8.0)
    mesh.add(0, 7, "replica", hop_weight=2.0, decode_step_ms=6.0)
    assert plan_with(mesh, ShardLoad(retry_s=1.0)) == [("primary", 0, 7)]


def test_the_chain_minimises_predicted_time_per_token_over_layer_ranges(mesh):
    # One shard for everything, slow per layer, against two fast halves: two hops win despite the extra trip.
    mesh.add(0, 7, "whole", decode_step_ms=80.0)
    mesh.add(0, 3, "front", decode_step_ms=4.0)
    mesh.add(4, 7, "back", decode_step_ms=4.0)
    load = ShardLoad(retry_s=1.0)
    assert plan_with(mesh, load) == [("front", 0, 3), ("back", 4, 7)]
    # Busy halves (three of our streams each) make the single fast-enough shard the better chain.
    for _ in range(3):
        load.hold([f"{MODEL_ID}:0-3@front", f"{MODEL_ID}:4-7@back"])
    mesh.add(0, 7, "whole", decode_step_ms=12.0, t=3.0, heartbeat_t=3.0)
    assert plan_with(mesh, load) == [("whole", 0, 7)]


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


def test_an_uncovered_layer_names_the_shards_holding_it_that_were_left_out_and_why(mesh):
    mesh.add(0, 3, "a")
    stale = mesh.add(4, 7, "stale", heartbeat_t=-40.0, t=-40.0)
    excluded = mesh.add(4, 5, "excluded")
    full = mesh.add(6, 7, "full")  # max_concurrent_streams is 2
    load = ShardLoad(retry_s=10.0)
    load.hold([full, full])
    router = mesh.router()
    with pytest.raises(RoutingError) as error:
        router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, exclude=[excluded], now=mesh.now, load=load)
    assert error.value.uncovered_layers == (4, 5, 6, 7)
    message = str(error.value)
    assert message.startswith("no healthy shard covers layers 4-7"), message
    assert f"{stale}: not heard from for 45 s (health_timeout_s=30)" in message
    assert f"{excluded}: excluded from this call" in message
    assert f"{full}: full (2 of 2 streams held" in message
    assert "@a:" not in message  # usable, and not holding an uncovered layer


def test_the_words_a_shard_was_excluded_with_stay_on_one_line_of_the_routing_failure(mesh):
    # They are a shard's own (its refusal's message): a newline in them must not make the client's error two lines.
    mesh.add(0, 3, "a")
    refusing = mesh.add(4, 7, "refusing")
    router = mesh.router()
    why = "refused: bad_request: no\r\nERROR: something else entirely\tand more"
    with pytest.raises(RoutingError) as error:
        router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, exclude={refusing: why}, now=mesh.now)
    message = str(error.value)
    assert len(message.splitlines()) == 1, message
    assert f"{refusing}: excluded from this call: refused: bad_request: no ERROR: something else entirely and more" \
        in message


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


def test_a_shard_advertising_another_layer_count_is_left_out_when_the_model_says_how_many(mesh):
    mesh.add(0, 7, "honest")
    mesh.add(0, 3, "liar", total=9)  # the same weights, one layer more: the model seemed to have 9
    router = mesh.router()
    candidates = router.candidates(MODEL_ID)
    with pytest.raises(RoutingError, match="no healthy shard covers layers 8"):
        router.plan(candidates, MODEL_ID, WEIGHTS_SHA, now=mesh.now)  # as the shards say: 9 layers, 8 uncovered
    hops = router.plan(candidates, MODEL_ID, WEIGHTS_SHA, now=mesh.now, model_layers=8)
    assert [(hop.node_id, hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops] == [("honest", 0, 7)]
    with pytest.raises(RoutingError, match="advertises 9 layers; the model has 8"):
        router.plan(candidates, MODEL_ID, WEIGHTS_SHA, now=mesh.now, exclude=[f"{MODEL_ID}:0-7@honest"],
                    model_layers=8)

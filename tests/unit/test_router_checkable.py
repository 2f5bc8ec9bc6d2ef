"""Routing a call that asks checks (its `verify` level: other replicas mirror each hop) over a chain they can be made
on: a whole-model replica beside two half-model shards on other nodes is the cheapest chain alone, but nobody could
check it; each half of the model can be checked on the other side (docs/design.md §5, router.py rule 2). A
conversation's kept prefix (affinity.py) does not move a call onto a chain less checkable than that."""

from __future__ import annotations

import pytest

from hearth.readmodels.queries import KeptChain
from hearth.services.orchestrator.affinity import prefer_kept
from hearth.services.orchestrator.check_policy import MIRRORS_PER_LEVEL
from hearth.services.orchestrator.predict import MirrorShortfall
from hearth.services.orchestrator.router import Hop
from tests.readmodel_helpers import MODEL_ID, WEIGHTS_SHA, migrated_engine
from tests.unit.test_router import Mesh


@pytest.fixture
def mesh(tmp_path):
    engine = migrated_engine(tmp_path / "router.db")
    yield Mesh(engine)
    engine.dispose()


def plan(mesh: Mesh, verify: str) -> list[Hop]:
    router = mesh.router()
    return router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, now=mesh.now,
                       mirrors_per_hop=MIRRORS_PER_LEVEL[verify])


def named(hops: list[Hop]) -> list[tuple[str, int, int]]:
    return [(hop.shard_id.split("@")[1], hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops]


def shortfall(mesh: Mesh, hops: list[Hop], verify: str) -> int:
    """The replicas the chain's hops lack for the level's checks, counted as a mirror is chosen."""
    candidates = mesh.router().candidates(MODEL_ID)
    by_id = {c.shard_id: c for c in candidates}
    lacking = MirrorShortfall(candidates, MIRRORS_PER_LEVEL[verify])
    return sum(lacking(by_id[hop.shard_id], hop.layer_lo_to_run, hop.layer_hi_to_run) for hop in hops)


def test_a_whole_replica_is_not_routed_alone_where_its_halves_could_be_checked(mesh):
    mesh.add(0, 3, "front")
    mesh.add(4, 7, "back")
    mesh.add(0, 7, "whole")
    assert named(plan(mesh, "none")) == [("whole", 0, 7)]  # one hop: the cheapest, and nothing asks checks
    for verify in ("sampled", "all"):
        hops = plan(mesh, verify)
        assert len(hops) == 2 and shortfall(mesh, hops, verify) == 0, named(hops)
    # `vote` asks two other nodes per hop, which no chain has here: the cheapest chain, as before.
    assert named(plan(mesh, "vote")) == [("whole", 0, 7)]


def test_a_replica_on_the_hops_own_node_does_not_count(mesh):
    # The whole-model replica shares the front half's node: it cannot vouch for that node's work.
    mesh.add(0, 3, "home")
    mesh.add(4, 7, "back")
    mesh.add(0, 7, "home")
    # Layers 0-3 run on "home" in every chain, and no other node has them: every chain lacks one replica, so the
    # cheapest is taken, as without checks.
    hops = plan(mesh, "all")
    assert named(hops) == [("home", 0, 7)] and shortfall(mesh, hops, "all") == 1


def test_checkability_comes_before_speed_and_speed_decides_among_checkable_chains(mesh):
    mesh.add(0, 7, "whole", decode_step_ms=4.0)
    mesh.add(0, 3, "front", decode_step_ms=80.0)
    mesh.add(4, 7, "back", decode_step_ms=8.0)
    assert named(plan(mesh, "none")) == [("whole", 0, 7)]
    # Of the chains every hop of which can be checked, the fastest: the whole replica's front half (checked by
    # "front"), then "back" (checked by the whole replica).
    assert named(plan(mesh, "sampled")) == [("whole", 0, 3), ("back", 4, 7)]


def test_a_shard_holds_at_most_one_hop_of_a_chain(mesh):
    # A fast shard of two middle layers inside a slow whole-model one: whole, fast, whole would be the cheapest
    # prediction, but a shard keeps one hop per pipeline (a second open of it replaces the first).
    mesh.add(0, 7, "whole", decode_step_ms=80.0)
    mesh.add(2, 3, "middle", decode_step_ms=2.0)
    for verify in ("none", "sampled"):
        assert named(plan(mesh, verify)) == [("whole", 0, 7)], verify


def with_affinity(mesh: Mesh, verify: str, kept: list[tuple[str, int, int]]) -> list[Hop]:
    """The chain a call opens when `kept` (node, layers) holds its long prompt's leading blocks: the planned chain or,
    when the prefill it saves outweighs its cost, the kept one (affinity.py)."""
    router = mesh.router()
    candidates = router.candidates(MODEL_ID)
    by_node = {c.node_id: c.shard_id for c in candidates}
    holding = KeptChain(hops=tuple((by_node[node], lo, hi) for node, lo, hi in kept), blocks=32)
    planned = plan(mesh, verify)
    chosen, _ = prefer_kept(planned, holding, {c.shard_id: c for c in candidates}, load=None, block_tokens=32,
                            prompt_positions=1025, max_tokens=40, prefill_token_cost=0.25,
                            mirrors_per_hop=MIRRORS_PER_LEVEL[verify])
    return chosen


def test_a_conversation_s_kept_chain_is_not_taken_where_it_could_not_be_checked(mesh):
    # An earlier turn (at `none`) kept its prompt on the whole-model replica alone, which nobody can check.
    mesh.add(0, 3, "front")
    mesh.add(4, 7, "back")
    mesh.add(0, 7, "whole")
    # At `none` nothing asks checks: the saved prefill decides, as before (here for the two halves' chain).
    assert named(with_affinity(mesh, "none", [("front", 0, 3), ("back", 4, 7)])) == [("front", 0, 3), ("back", 4, 7)]
    # At `sampled` (the default) the kept chain would leave the call `unmet`: the checkable chain, re-prefilled.
    for verify in ("sampled", "all"):
        hops = with_affinity(mesh, verify, [("whole", 0, 7)])
        assert hops == plan(mesh, verify) and shortfall(mesh, hops, verify) == 0, named(hops)
    # Among chains as checkable as the planned one, the kept prefix still decides.
    for kept in ([("front", 0, 3), ("whole", 4, 7)], [("whole", 0, 3), ("back", 4, 7)],
                 [("front", 0, 3), ("back", 4, 7)]):
        assert named(with_affinity(mesh, "sampled", kept)) == kept
    # Where no chain has the replicas (`vote` asks two other nodes per hop), every chain lacks them alike: the kept one.
    assert named(with_affinity(mesh, "vote", [("front", 0, 3), ("back", 4, 7)])) == [("front", 0, 3), ("back", 4, 7)]


def test_a_shard_advertising_another_layer_count_is_neither_a_hop_of_a_kept_chain_nor_a_checking_replica(mesh):
    # The whole-model replica advertises 16 layers where the model has 8: routing leaves it out (router.py `plan`),
    # and so must the kept prefix weighed over the same shards (construct.py asks router.py `usable` for them).
    mesh.add(0, 3, "front")
    mesh.add(4, 7, "back")
    mesh.add(0, 7, "whole", total=16)
    router = mesh.router()
    candidates = router.candidates(MODEL_ID)
    usable = {c.shard_id: c for c in router.usable(candidates, WEIGHTS_SHA, now=mesh.now, model_layers=8)}
    assert sorted(c.node_id for c in usable.values()) == ["back", "front"]
    planned = router.plan(candidates, MODEL_ID, WEIGHTS_SHA, now=mesh.now, model_layers=8,
                          mirrors_per_hop=MIRRORS_PER_LEVEL["sampled"])
    assert named(planned) == [("front", 0, 3), ("back", 4, 7)]
    by_node = {c.node_id: c.shard_id for c in candidates}
    # Counted as a replica, "whole" would check both halves and the kept chain through it would be as checkable
    # as the planned one, and taken for the prefill it saves.
    holding = KeptChain(hops=((by_node["front"], 0, 3), (by_node["whole"], 4, 7)), blocks=32)
    def affinity(over: dict) -> list[Hop]:
        return prefer_kept(planned, holding, over, load=None, block_tokens=32, prompt_positions=1025, max_tokens=40,
                           prefill_token_cost=0.25, mirrors_per_hop=MIRRORS_PER_LEVEL["sampled"])[0]

    # Over every live shard (the filter construct.py had), "whole" is a hop of the chain taken and checks "front".
    assert named(affinity({c.shard_id: c for c in candidates})) == [("front", 0, 3), ("whole", 4, 7)]
    assert affinity(usable) == planned

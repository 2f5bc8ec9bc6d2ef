"""Routing on a mesh serving two models, two schemes and a same-name checkpoint of other weights: a chain is of one
model, one scheme and one set of weights; a refusal's code says what would have served the call (weights_mismatch
only where shards of other weights could have run the scheme the call is held to)."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import sessionmaker

from hearth.readmodels.batch_rows import epoch_s
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from tests.readmodel_helpers import MODEL_ID, T0, WEIGHTS_SHA, LogBuilder, advertised, apply_all, migrated_engine

OTHER_MODEL = "tiny/qwen-test"
OTHER_SEED = "cd" * 32


class Mesh:
    """A read model of adverts of two models and a router over it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.log = LogBuilder()
        self.now = epoch_s(T0) + 5.0

    def add(self, lo: int, hi: int, node: str, scheme: str = "none", **fields) -> str:
        shard = advertised(lo, hi, node, quantization=scheme, **fields)
        apply_all(self.engine, [self.log.stored(shard)])
        return shard.shard_id

    def plan(self, model_id: str = MODEL_ID, *, quantization: str | None = None, exclude=()) -> list[str]:
        router = ShardRouter(sessionmaker(self.engine), health_timeout_s=30.0, allow_self_as_shard=False,
                             self_node_id="hub", clock=lambda: self.now)
        hops = router.plan(router.candidates(model_id), model_id, WEIGHTS_SHA, exclude=exclude, now=self.now,
                           quantization=quantization)
        return [hop.shard_id for hop in hops]


@pytest.fixture
def mesh(tmp_path):
    engine = migrated_engine(tmp_path / "router.db")
    yield Mesh(engine)
    engine.dispose()


def test_a_chain_is_of_the_named_model_only(mesh):
    ours = [mesh.add(0, 3, "a"), mesh.add(4, 7, "b")]
    # The other model's shards are cheaper by hop weight and sit on the same nodes.
    theirs = [mesh.add(0, 7, "a", model_id=OTHER_MODEL, hop_weight=0.1),
              mesh.add(4, 7, "c", model_id=OTHER_MODEL, hop_weight=0.1)]
    assert mesh.plan() == ours
    assert mesh.plan(OTHER_MODEL) == theirs[:1]


def test_shards_of_other_weights_never_join_a_chain(mesh):
    ours = mesh.add(0, 3, "a")
    mesh.add(4, 7, "e", weights_sha256=OTHER_SEED)
    with pytest.raises(RoutingError) as refused:
        mesh.plan()
    assert refused.value.code == "weights_mismatch" and "layers 4-7" in refused.value.message
    replica = mesh.add(4, 7, "b")
    mesh.add(0, 7, "f", weights_sha256=OTHER_SEED, hop_weight=0.1)
    assert mesh.plan() == [ours, replica]


def test_a_call_held_to_a_scheme_is_not_told_of_other_weights_in_another_scheme(mesh):
    # int8 of ours covers 0-3 only; another seed's full-precision shard covers everything: with our weights it
    # would make a full-precision chain, never an int8 one, so an int8 call lacks shards, not other weights.
    mesh.add(0, 3, "a", "int8")
    mesh.add(0, 7, "e", weights_sha256=OTHER_SEED)
    with pytest.raises(RoutingError) as refused:
        mesh.plan(quantization="int8")
    assert refused.value.code == "shard_unavailable", refused.value.message
    assert "layers 4-7" in refused.value.message and "'int8'" in refused.value.message
    # Other weights serving the scheme the call is held to: that is what lacks.
    mesh.add(4, 7, "g", "int8", weights_sha256=OTHER_SEED)
    with pytest.raises(RoutingError) as mismatched:
        mesh.plan(quantization="int8")
    assert mismatched.value.code == "weights_mismatch" and "'int8'" in mismatched.value.message


def test_a_scheme_only_other_weights_serve_is_refused_as_unavailable_naming_it(mesh):
    mesh.add(0, 7, "e", weights_sha256=OTHER_SEED)
    with pytest.raises(RoutingError) as refused:
        mesh.plan(quantization="int4")
    assert refused.value.code == "shard_unavailable" and "'int4'" in refused.value.message
    assert "\n" not in refused.value.message


def test_failover_of_a_pinned_scheme_takes_neither_another_scheme_nor_other_weights(mesh):
    mesh.add(0, 3, "a")
    failed = mesh.add(4, 7, "b")
    mesh.add(4, 7, "i8", "int8", hop_weight=0.1)
    mesh.add(4, 7, "e", weights_sha256=OTHER_SEED, hop_weight=0.1)
    with pytest.raises(RoutingError) as refused:
        mesh.plan(quantization="none", exclude={failed})
    assert "layers 4-7" in refused.value.message
    replica = mesh.add(4, 7, "c")
    assert mesh.plan(quantization="none", exclude={failed})[1] == replica

"""Quantization as part of a shard's identity: adverts carry the scheme into the read model, a chain never mixes
schemes, the most precise fully covered one is preferred, a requested or pinned scheme is honoured (failover
included), and `llm.models` lists the schemes each model is served in."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.models import ShardAdvertised
from hearth.readmodels.batch_rows import epoch_s
from hearth.readmodels.queries import ShardCandidate
from hearth.readmodels.tables import Shard
from hearth.protocol.chat import BadRequest, ChatRequest, parse_chat_request
from hearth.protocol.quantization_labels import accepts, precision_order
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.services.orchestrator.discovery import served_model
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from tests.readmodel_helpers import MODEL_ID, T0, WEIGHTS_SHA, LogBuilder, advertised, apply_all, migrated_engine


class Mesh:
    """A read model of mixed-scheme adverts and a router over it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.log = LogBuilder()
        self.now = epoch_s(T0) + 5.0

    def add(self, lo: int, hi: int, node: str, scheme: str, **fields) -> str:
        shard = advertised(lo, hi, node, quantization=scheme, **fields)
        apply_all(self.engine, [self.log.stored(shard)])
        return shard.shard_id

    def plan(self, *, quantization: str | None = None, exclude=()) -> list[tuple[str, str]]:
        router = ShardRouter(sessionmaker(self.engine), health_timeout_s=30.0, allow_self_as_shard=False,
                             self_node_id="hub", clock=lambda: self.now)
        hops = router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, exclude=exclude, now=self.now,
                           quantization=quantization)
        return [(hop.shard_id.split("@")[1], hop.quantization) for hop in hops]


@pytest.fixture
def mesh(tmp_path):
    engine = migrated_engine(tmp_path / "router.db")
    yield Mesh(engine)
    engine.dispose()


def test_the_projection_stores_the_scheme_and_old_adverts_read_as_none(mesh):
    quantized = mesh.add(0, 3, "a", "int4/g64")
    old = advertised(4, 7, "b").model_dump(mode="json")
    old.pop("quantization")
    legacy = ShardAdvertised.model_validate(old)
    apply_all(mesh.engine, [mesh.log.stored(legacy)])
    with Session(mesh.engine) as session:
        assert session.get(Shard, quantized).quantization == "int4/g64"
        assert session.get(Shard, legacy.shard_id).quantization == "none"


def test_the_most_precise_fully_covered_scheme_wins_and_a_chain_never_mixes(mesh):
    # Full precision covers only layers 0-3: together with int8's 4-7 it would cover, but schemes never mix.
    mesh.add(0, 3, "fp-a", "none")
    mesh.add(0, 3, "i8-a", "int8")
    mesh.add(4, 7, "i8-b", "int8")
    mesh.add(0, 7, "i4", "int4/g64")
    assert mesh.plan() == [("i8-a", "int8"), ("i8-b", "int8")]
    mesh.add(4, 7, "fp-b", "none")
    assert mesh.plan() == [("fp-a", "none"), ("fp-b", "none")]


def test_a_requested_scheme_is_honoured(mesh):
    mesh.add(0, 7, "fp", "none")
    mesh.add(0, 7, "i8", "int8")
    mesh.add(0, 3, "i4-a", "int4/g64")
    mesh.add(4, 7, "i4-b", "int4/g64")
    assert mesh.plan(quantization="int8") == [("i8", "int8")]
    # A bare "int4" takes any group size; "int4/g64" only that one.
    assert mesh.plan(quantization="int4") == [("i4-a", "int4/g64"), ("i4-b", "int4/g64")]
    assert mesh.plan(quantization="int4/g64") == [("i4-a", "int4/g64"), ("i4-b", "int4/g64")]


def test_a_scheme_nobody_serves_is_refused_naming_it(mesh):
    mesh.add(0, 7, "fp", "none")
    mesh.add(0, 3, "i8", "int8")
    with pytest.raises(RoutingError) as refused:
        mesh.plan(quantization="int4/g32")
    assert refused.value.code == "shard_unavailable"
    assert "'int4/g32'" in refused.value.message and "none, int8" in refused.value.message
    assert "\n" not in refused.value.message
    with pytest.raises(RoutingError) as partial:
        mesh.plan(quantization="int8")
    assert partial.value.code == "shard_unavailable"
    assert "layers 4-7" in partial.value.message and "'int8'" in partial.value.message


def test_failover_moves_only_to_a_replica_of_the_same_scheme(mesh):
    mesh.add(0, 3, "i8-a", "int8")
    failed = mesh.add(4, 7, "i8-b", "int8")
    mesh.add(4, 7, "fp-b", "none")
    # The call was pinned to int8 by its first chain; the full-precision replica of the range is never chosen.
    with pytest.raises(RoutingError) as refused:
        mesh.plan(quantization="int8", exclude={failed})
    assert "layers 4-7" in refused.value.message
    mesh.add(4, 7, "i8-c", "int8")
    assert mesh.plan(quantization="int8", exclude={failed}) == [("i8-a", "int8"), ("i8-c", "int8")]


def test_a_call_starts_from_its_requested_scheme():
    request = ChatRequest(prompt="hello", params={"quantization": "int8"})
    assert Call(request=request, model=None, client=None).quantization == "int8"
    assert Call(request=ChatRequest(prompt="hello"), model=None, client=None).quantization is None


@pytest.mark.parametrize("label", ["int3", "int4/g0", "INT8", "int8 ", "fp8", "int8\n", "{label}"])
def test_a_malformed_scheme_is_a_bad_request_naming_the_field_in_plain_words(label):
    body = ChatRequest(prompt="hello").model_dump(mode="json")
    body["params"]["quantization"] = label
    with pytest.raises(BadRequest) as refused:
        parse_chat_request(json.dumps(body).encode())
    assert str(refused.value) == (f"field 'params.quantization': {label!r} names no scheme: expected none, int8, "
                                  "int4 or int4/gN (N: a group size)")  # as `hearth chat --quantization` says it


def test_labels_order_and_acceptance():
    labels = ["int4/g64", "none", "int4/g32", "int8"]
    assert sorted(labels, key=precision_order) == ["none", "int8", "int4/g32", "int4/g64"]
    assert accepts(None, "int4/g64") and accepts("int4", "int4/g32") and not accepts("int4/g32", "int4/g64")
    assert not accepts("int8", "none")


def candidate(lo: int, hi: int, scheme: str, node: str) -> ShardCandidate:
    return ShardCandidate(shard_id=f"m:{lo}-{hi}@{node}", model_id="m", weights_sha256=WEIGHTS_SHA, node_id=node,
                          layer_lo=lo, layer_hi=hi, total_layers=8, control_subject="c", hop_weight=1.0,
                          max_concurrent_streams=1, status="advertised", advertised_at=0, expires_at=10,
                          last_seen=None, queue_depth=None, active_streams=None, quantization=scheme)


def test_models_list_the_schemes_each_model_is_served_in():
    served = served_model("m", [candidate(0, 7, "int8", "a"), candidate(0, 3, "none", "b"),
                                candidate(0, 3, "int4/g64", "c"), candidate(4, 7, "int4/g64", "d")])
    assert served.complete and served.quantizations == ["int8", "int4/g64"]
    assert served.covered_layers == [(0, 7)]
    partial = served_model("m", [candidate(0, 3, "none", "a"), candidate(4, 7, "int8", "b")])
    assert not partial.complete and partial.quantizations == []


async def test_the_local_fallback_is_refused_to_a_call_of_another_scheme_before_anything_loads(tmp_path):
    catalog = ModelCatalog([tmp_path], local_model="not-loaded-unless-used")
    catalog.use_compute("cpu", None, quantization="none")
    # A call whose chains serve int8 must not finish on full-precision weights: its tokens would change.
    assert await catalog.local_model_for(loaded=None, quantization="int8") is None
    assert await catalog.local_model_for(loaded=None, quantization="int4/g64") is None

"""A shard's identity: model, layer range, quantization scheme and node. One node serving one range in two schemes
runs two shards (their own ids, subjects and read-model rows); an unquantized shard keeps the id it always had; and
every reader of a shard id (failover chains, the demo's labels, the node it names) reads the scheme's form too."""

from __future__ import annotations

import asyncio

import pytest

from hearth.protocol.subjects import ShardIdParts, parse_shard_id, shard_id_for, shard_key
from hearth.readmodels.pipeline_hops import hops_after_failover
from hearth.protocol.subjects import node_of_shard
from hearth.services.common.config import HearthSettings
from hearth.services.devtools.demo import shard_label
from hearth.services.shard.main import load_shard
from tests.unit.test_router_quantization import Mesh

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)


async def test_one_range_in_two_schemes_on_one_node_loads_as_two_shards(tiny_model_dir):
    path = tiny_model_dir("llama")
    identities = {}
    for scheme in ("none", "int8", "int4/g32"):
        loaded = await load_shard(model=str(path), lo=0, hi=1, node="n1", settings=HearthSettings(), model_id=None,
                                  device="cpu", dtype=None, quantize=scheme, stop_event=asyncio.Event())
        identities[scheme] = loaded.identity
        loaded.runner.close()
    model = identities["none"].model_id
    # Unquantized, the id is what it always was; each quantized scheme is a shard of its own.
    assert identities["none"].shard_id == f"{model}:0-1@n1"
    assert identities["int8"].shard_id == f"{model}:0-1+int8@n1"
    assert len({identity.shard_id for identity in identities.values()}) == 3
    assert len({identity.control_subject for identity in identities.values()}) == 3
    assert len({shard_key(identity.shard_id) for identity in identities.values()}) == 3


@pytest.mark.parametrize("model", ["tiny-llama", "Qwen/Qwen2.5-0.5B-Instruct", "ollama:gemma3:4b"])
@pytest.mark.parametrize("scheme", ["none", "int8", "int4/g64"])
def test_a_shard_id_reads_back_as_its_parts(model, scheme):
    shard_id = shard_id_for(model, 12, 23, "attic-box", quantization=scheme)
    assert parse_shard_id(shard_id) == ShardIdParts(model, 12, 23, scheme, "attic-box")
    assert node_of_shard(shard_id) == "attic-box"
    assert parse_shard_id("not a shard id") is None


def test_a_failover_that_repicks_a_quantized_chain_replaces_it_whole():
    old = [shard_id_for("m", 0, 2, node, quantization="int8") for node in ("a", "b")]
    new = [shard_id_for("m", 0, 3, "c", quantization="int8"), shard_id_for("m", 4, 5, "d", quantization="int8")]
    assert hops_after_failover(old, old[1], new) == new


def test_the_demo_labels_a_quantized_shard_with_its_layers_and_scheme():
    assert shard_label(shard_id_for("m", 0, 1, "demo-host-0")) == "demo-host-0 [layers 0-1]"
    assert shard_label(shard_id_for("m", 0, 1, "demo-host-0", quantization="int8")) == \
        "demo-host-0 [layers 0-1, int8]"


def test_a_node_advertising_one_range_in_two_schemes_is_routed_in_each(tmp_path):
    from tests.readmodel_helpers import migrated_engine

    engine = migrated_engine(tmp_path / "router.db")
    try:
        mesh = Mesh(engine)
        int8, int4 = mesh.add(0, 7, "n1", "int8"), mesh.add(0, 7, "n1", "int4/g64")
        assert int8 != int4
        assert mesh.plan(quantization="int8") == [("n1", "int8")]
        assert mesh.plan(quantization="int4/g64") == [("n1", "int4/g64")]
    finally:
        engine.dispose()

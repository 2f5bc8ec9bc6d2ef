"""A hop's `open` names the scheme the chain was planned on, and a shard serving another scheme refuses it: a shard
restarted under the same id in another scheme (its old advert still in a read model) never joins a chain of the old
one, so a pipeline never mixes schemes and a failover's greedy output stays identical."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hearth.protocol.control import OpenHop
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.router import Hop
from hearth.services.shard.identity import ShardIdentity, open_refusal
from tests.unit.test_seal_handover import RecordingNats


def identity(quantization: str) -> ShardIdentity:
    return ShardIdentity(shard_id="m:0-7@n0", model_id="m", node_id="n0", weights_sha256="w", layer_lo=0, layer_hi=7,
                         total_layers=8, dtype="float32", memory_required_mb=1.0, control_subject="c",
                         quantization=quantization)


async def open_for(scheme: str) -> OpenHop:
    nc = RecordingNats()
    hop = Hop("m:0-7@n0", "c", "n0", 0, 7, quantization=scheme)
    chain = HopChain(nc, "p-scheme", [hop], node_id="orch", model_id="m", weights_sha256="w",
                     transport=TransportSettings())
    await chain._open_hop(0, hop)
    return nc.opens[0]


async def test_an_open_names_the_hops_scheme():
    assert (await open_for("int4/g64")).quantization == "int4/g64"


async def test_a_shard_refuses_an_open_planned_on_another_scheme():
    planned_int8 = await open_for("int8")
    refused = open_refusal(planned_int8, identity("none"), None, False)
    assert refused is not None and refused.code == "weights_mismatch" and "int8" in refused.message
    assert open_refusal(planned_int8, identity("int8"), None, False) is None


def test_an_open_from_before_schemes_were_named_is_not_refused_for_it():
    old = OpenHop(pipeline_id="p", session_id="s", hop=0, hop_count=1, model_id="m", weights_sha256="w", layer_lo=0,
                  layer_hi=7)
    assert old.quantization is None and open_refusal(old, identity("int8"), None, False) is None


def test_a_malformed_scheme_in_an_open_fails_validation():
    with pytest.raises(ValidationError, match="quantization"):
        OpenHop(pipeline_id="p", session_id="s", hop=0, hop_count=1, model_id="m", weights_sha256="w", layer_lo=0,
                layer_hi=7, quantization="int3")

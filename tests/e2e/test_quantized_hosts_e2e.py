"""`hearth host --quantize int4` over real processes: the budget counts the layers' int4 bytes, so two hosts whose
budget holds less than one full-precision layer each take three int4 layers, cover the model together, advertise
needs within their budget, and answer with the tokens of the same int4 weights in one process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.inference.memory import MiB, layer_weight_bytes
from hearth.inference.quantization import DEFAULT_INT4_GROUP_SIZE
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_LAYERS, TINY_MODEL_NAME, start_orchestrator
from tests.e2e.test_hearth_host_e2e import advertisements
from tests.e2e.test_quantized_mesh import one_process_greedy_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SHARD_ENV = "HEARTH_SHARD__"
KV_RESERVE_MB = 0.02
LAYERS_PER_HOST = 3
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


async def test_int4_hosts_take_the_layers_their_budget_holds_in_int4(cluster, tiny_models_dir):
    path = tiny_models_dir / TINY_MODEL_NAME
    int4_layer = max(layer_weight_bytes(path, torch.float32, quantization="int4").values())
    fp32_layer = min(layer_weight_bytes(path, torch.float32).values())
    # Room for three and a half int4 layers: less than one full-precision layer.
    budget_mb = KV_RESERVE_MB + (LAYERS_PER_HOST + 0.5) * int4_layer / MiB
    assert (budget_mb - KV_RESERVE_MB) * MiB < fp32_layer
    cluster.extra_env.update({SHARD_ENV + "KV_CACHE_BUDGET_MB": str(KV_RESERVE_MB)})
    for name in "ab":  # one after another: the second sees the first's layers
        cluster.start_host(str(path), budget_mb, node_id=f"host-{name}", extra_args=["--quantize", "int4"])
    start_orchestrator(cluster, tiny_models_dir, extra_args=["--quantize", "int4"], wait_ready=True)

    adverts = {a.node_id: a for a in await advertisements(cluster)}
    assert [(adverts[f"host-{name}"].layer_lo, adverts[f"host-{name}"].layer_hi) for name in "ab"] == [
        (0, LAYERS_PER_HOST - 1), (LAYERS_PER_HOST, TINY_LAYERS - 1)]
    for advert in adverts.values():
        assert advert.quantization == f"int4/g{DEFAULT_INT4_GROUP_SIZE}"
        assert advert.memory_required_mb <= budget_mb, advert

    nc = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:
        result = await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                            temperature=0.0, params=ChatParams(fallback_to_local=False)))
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    assert result.ok, result.final
    assert result.token_ids == await asyncio.to_thread(one_process_greedy_tokens, path, "int4", PROMPT, NEW_TOKENS)

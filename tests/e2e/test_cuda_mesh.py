"""A mesh of real processes on a GPU (skipped where torch sees none): shards and orchestrator with `--device cuda`
give generate()'s greedy tokens on the same device in fp32, and mostly the same in bf16; shards advertise the GPU."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.inference import SamplingParams, load_full
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator, start_three_shards
from tests.e2e.test_hearth_host_e2e import advertisements

pytestmark = [pytest.mark.e2e, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here")]

PROMPT = "the quick brown fox jumps over the lazy dog"
NEW_TOKENS = 16


def reference(path, dtype: torch.dtype) -> list[int]:
    input_ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    with torch.inference_mode():
        output = model.generate(torch.tensor([input_ids], device="cuda"), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    return output[0, len(input_ids):].tolist()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
async def test_a_gpu_mesh_gives_generate_s_tokens(cluster, tiny_models_dir, dtype):
    placement = ["--device", "cuda", "--dtype", dtype]
    start_three_shards(cluster, tiny_models_dir / TINY_MODEL_NAME, extra_args=placement)
    start_orchestrator(cluster, tiny_models_dir, extra_args=placement)
    cluster.wait_all_ready()
    nc = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:
        # Two calls one after the other: the second captures new graphs once the first's sessions, and with them
        # every graph of a shard's memory pool, are gone (that capture once failed an allocator assert).
        results = [await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
                   for _ in range(2)]
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    assert all(result.ok for result in results), [result.final for result in results]
    assert results[1].token_ids == results[0].token_ids
    result = results[0]
    expected = reference(tiny_models_dir / TINY_MODEL_NAME, torch.float32 if dtype == "fp32" else torch.bfloat16)
    if dtype == "fp32":
        assert result.token_ids == expected
    else:
        agreeing = next((i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b), NEW_TOKENS)
        assert agreeing >= NEW_TOKENS // 2, (result.token_ids, expected)
    for advertised in await advertisements(cluster):
        assert advertised.device_kind == "cuda" and advertised.device_name


async def test_an_int4_gpu_mesh_answers_like_one_process_with_the_same_weights(cluster, tiny_models_dir):
    placement = ["--device", "cuda", "--dtype", "bf16", "--quantize", "int4/g32"]
    start_three_shards(cluster, tiny_models_dir / TINY_MODEL_NAME, extra_args=placement)
    start_orchestrator(cluster, tiny_models_dir, extra_args=placement)
    cluster.wait_all_ready()
    nc = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:
        result = await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    assert result.ok, result.final
    local = load_full(tiny_models_dir / TINY_MODEL_NAME, device="cuda", dtype="bf16", quantization="int4/g32",
                      **RUNNER_KV_LIMITS)
    prompt_ids = local.head.encode_prompt(PROMPT)
    expected = list(local.generate_ids(prompt_ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)))
    agreeing = next((i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b), NEW_TOKENS)
    assert agreeing >= NEW_TOKENS // 2, (result.token_ids, expected)
    for advertised in await advertisements(cluster):
        assert advertised.device_kind == "cuda" and advertised.quantization == "int4/g32"

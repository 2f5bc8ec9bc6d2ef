"""A mesh started from the community's store over real processes on a community (roster) broker: the steward
publishes a checkpoint with `hearth weights publish`, two shard hosts start with `--model store:NAME` on fixed
ranges, a `hearth host` sizes itself from the manifest and takes the remaining range, the orchestrator preloads
`store:NAME`; the greedy answer equals generate() on the original folder, and each process's cache holds only the
objects of what it serves."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.inference.checkpoint import SAFETENSORS_DTYPES
from hearth.protocol.chat import ChatRequest
from hearth.services.weights_store import HEAD_OBJECT, LAYER_OBJECT_FORMAT
from tests.e2e.conftest import TINY_MODEL_NAME, chat_once, publish_to_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STORE_NAME = "community-llama"
SHARD_ENV = "HEARTH_SHARD__"
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


def greedy_reference(path: Path) -> list[int]:
    input_ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model.generate(torch.tensor([input_ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return output[0, len(input_ids):].tolist()


def weight_bytes(path: Path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                stored = handle.get_slice(name)
                total += math.prod(stored.get_shape()) * SAFETENSORS_DTYPES[stored.get_dtype()].itemsize
    return total


def cached_objects(cache_dir: Path) -> set[str]:
    return {file.name for file in (cache_dir / "store" / STORE_NAME).glob("*/objects/*.safetensors")}


def layer_objects(lo: int, hi: int) -> set[str]:
    return {LAYER_OBJECT_FORMAT.format(layer) for layer in range(lo, hi + 1)}


async def test_a_mesh_started_from_the_store_answers_as_the_original(cluster, tiny_models_dir, tmp_path):
    path = tiny_models_dir / TINY_MODEL_NAME
    publish_to_store(cluster, path, STORE_NAME)

    caches = {name: tmp_path / f"cache-{name}" for name in ("s0", "s1", "host", "orchestrator")}
    model = f"store:{STORE_NAME}"
    for node, (lo, hi) in (("s0", (0, 1)), ("s1", (2, 3))):
        cluster.extra_env["HEARTH_CACHE_DIR"] = str(caches[node])
        cluster.start_shard(model, lo, hi, node_id=node)
    # A budget that holds two of the six fp32 layers with a tiny KV reserve: the host takes the hole, 4-5.
    cluster.extra_env.update({"HEARTH_CACHE_DIR": str(caches["host"]), SHARD_ENV + "KV_CACHE_BUDGET_MB": "0.02"})
    cluster.start_host(model, 0.4 * weight_bytes(path) / 2**20, node_id="host")
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(caches["orchestrator"])
    cluster.start_orchestrator(extra_args=["--preload", model])
    expected = await asyncio.to_thread(greedy_reference, path)

    result = await chat_once(cluster, ChatRequest(model=STORE_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
    assert result.ok, result.final
    assert result.token_ids == expected
    assert result.frames_of("pipeline")[0].hops == [
        f"{STORE_NAME}:0-1@s0", f"{STORE_NAME}:2-3@s1", f"{STORE_NAME}:4-5@host"]
    assert cached_objects(caches["s0"]) == layer_objects(0, 1)
    assert cached_objects(caches["s1"]) == layer_objects(2, 3)
    assert cached_objects(caches["host"]) == layer_objects(4, 5)
    assert cached_objects(caches["orchestrator"]) == {HEAD_OBJECT}

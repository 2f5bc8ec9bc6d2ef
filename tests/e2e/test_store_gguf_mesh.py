"""A GGUF mesh started from the community's store over real processes on a community broker: the steward publishes a
tiny Q8_0 GGUF with `hearth weights publish`, one shard host loads its range from the store, another from the GGUF
file itself, and the orchestrator preloads `store:NAME`; they form one pipeline (one weights digest), the greedy
answer equals the file's own, and the store's host and orchestrator fetched only their objects."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from hearth.inference import SamplingParams, load_full
from hearth.protocol.chat import ChatRequest
from tests.e2e.conftest import chat_once, publish_to_store
from hearth.services.weights_store import GGUF_HEAD_OBJECT, GGUF_HEADER_OBJECT, GGUF_LAYER_OBJECT_FORMAT
from tests.runner_limits import RUNNER_KV_LIMITS
from tests.unit.gguf_files import write_tiny_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STORE_NAME = "community-gguf"
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


def greedy_reference(path: Path) -> list[int]:
    """The file's greedy tokens in one process, its weights held as the mesh's default holds them (auto: the Q8_0
    layers in int8, the Q8_0 head as stored)."""
    model = load_full(path, quantization="auto", **RUNNER_KV_LIMITS)
    try:
        prompt = model.head.encode_prompt(PROMPT)
        return list(model.generate_ids(prompt, SamplingParams(max_tokens=NEW_TOKENS)))
    finally:
        model.close()


def cached_objects(cache_dir: Path) -> set[str]:
    return {file.name for file in (cache_dir / "store" / STORE_NAME).glob("*/objects/*")
            if not file.name.startswith(".")}


async def test_store_and_file_hosts_of_one_gguf_form_one_pipeline(cluster, tmp_path):
    (tmp_path / "model").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "model", "llama", GGMLQuantizationType.Q8_0)
    publish_to_store(cluster, path, STORE_NAME)

    caches = {name: tmp_path / f"cache-{name}" for name in ("store-host", "file-host", "orchestrator")}
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(caches["store-host"])
    cluster.start_shard(f"store:{STORE_NAME}", 0, 2, node_id="store-host", wait_ready=False)
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(caches["file-host"])
    cluster.start_shard(str(path), 3, 5, node_id="file-host", extra_args=["--model-id", STORE_NAME],
                        wait_ready=False)
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(caches["orchestrator"])
    cluster.start_orchestrator(extra_args=["--preload", f"store:{STORE_NAME}"], wait_ready=False)
    cluster.wait_all_ready()
    expected = await asyncio.to_thread(greedy_reference, path)

    result = await chat_once(cluster, ChatRequest(model=STORE_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
    assert result.ok, result.final
    assert result.token_ids == expected
    # A range fetched from the store resolves the default as the whole file does: one scheme, one pipeline.
    assert result.frames_of("pipeline")[0].hops == [f"{STORE_NAME}:0-2+int8@store-host",
                                                    f"{STORE_NAME}:3-5+int8@file-host"]
    assert cached_objects(caches["store-host"]) == {GGUF_HEADER_OBJECT,
                                                    *(GGUF_LAYER_OBJECT_FORMAT.format(i) for i in range(3))}
    assert cached_objects(caches["orchestrator"]) == {GGUF_HEADER_OBJECT, GGUF_HEAD_OBJECT}

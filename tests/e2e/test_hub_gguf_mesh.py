"""A GGUF mesh started from a hub id naming one of a repository's GGUFs (`org/name:FILE.gguf`), over real processes
and a local server speaking the hub's protocol: one shard host reads its range by byte ranges, another loads the
file itself, and the orchestrator preloads the id and reads only the head's bytes; they form one pipeline (one
weights digest), the greedy answer equals the whole file's own, and nothing downloaded the whole file. An
orchestrator started without the id fetches the head when a request names it (the shards advertise it) and answers
with the same tokens; a GGUF of the repository nobody serves is refused in one line naming it."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from gguf import GGMLQuantizationType

from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from hearth.services.client.chat import list_models
from hearth.services.devtools.local_cluster import LocalCluster
from tests.e2e.conftest import chat_once
from tests.e2e.test_store_gguf_mesh import NEW_TOKENS, PROMPT, greedy_reference
from tests.unit.gguf_files import write_tiny_gguf
from tests.unit.hub_server import fake_hub  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = "tiny-org/tiny-gguf"
FILE = "tiny-Q8_0.gguf"
UNSERVED_FILE = "tiny-Q4_0.gguf"
models_wait_s = 60.0


async def wait_until_complete(cluster: LocalCluster, model: str) -> None:
    """Until `llm.models` says live shards cover every layer of `model` (a fresh orchestrator has read them)."""
    nc = await connect_nats(cluster.nats_url, name="e2e-models", settings=cluster.nats_settings())
    try:
        deadline = time.monotonic() + models_wait_s
        while not any(m.id == model and m.complete for m in (await list_models(nc)).models):
            assert time.monotonic() < deadline, f"{model} never listed as complete"
            await asyncio.sleep(0.2)
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


async def test_ranged_and_whole_file_hosts_of_a_hub_gguf_form_one_pipeline(cluster, fake_hub, tmp_path):  # noqa: F811
    (tmp_path / "model").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "model", "llama", GGMLQuantizationType.Q8_0)
    (tmp_path / "other").mkdir()
    other, _ = write_tiny_gguf(tmp_path / "other", "llama", GGMLQuantizationType.Q4_0, seed=1)
    repository = tmp_path / "repository"
    repository.mkdir()
    shutil.copyfile(path, repository / FILE)
    shutil.copyfile(other, repository / UNSERVED_FILE)
    fake_hub.repos[REPO] = repository
    model = f"{REPO}:{FILE}"

    cluster.extra_env["HF_ENDPOINT"] = fake_hub.url
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(tmp_path / "cache-hub-host")
    cluster.start_shard(model, 0, 2, node_id="hub-host", wait_ready=False)
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(tmp_path / "cache-file-host")
    cluster.start_shard(str(path), 3, 5, node_id="file-host", extra_args=["--model-id", model], wait_ready=False)
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(tmp_path / "cache-orchestrator")
    preloaded = cluster.start_orchestrator(extra_args=["--preload", model], wait_ready=False)
    cluster.wait_all_ready()
    expected = await asyncio.to_thread(greedy_reference, path)

    result = await chat_once(cluster, ChatRequest(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS))
    assert result.ok, result.final
    assert result.token_ids == expected
    assert result.frames_of("pipeline")[0].hops == [f"{model}:0-2+int8@hub-host", f"{model}:3-5+int8@file-host"]
    assert fake_hub.downloaded(REPO) == set() and fake_hub.bytes_sent < 2 * path.stat().st_size

    # Another orchestrator, not told of the id: the request's name alone makes it fetch the head, by byte ranges.
    preloaded.stop()
    cluster.extra_env["HEARTH_CACHE_DIR"] = str(tmp_path / "cache-orchestrator-on-request")
    cluster.start_orchestrator(node_id="on-request")
    await wait_until_complete(cluster, model)
    on_request = await chat_once(cluster, ChatRequest(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS))
    assert on_request.ok, on_request.final
    assert on_request.token_ids == expected
    assert fake_hub.downloaded(REPO) == set() and fake_hub.bytes_sent < 3 * path.stat().st_size

    unserved = f"{REPO}:{UNSERVED_FILE}"
    refused = await chat_once(cluster, ChatRequest(model=unserved, prompt=PROMPT, max_tokens=NEW_TOKENS))
    assert refused.final.code == "bad_request" and unserved in refused.final.message, refused.final
    assert "\n" not in refused.final.message

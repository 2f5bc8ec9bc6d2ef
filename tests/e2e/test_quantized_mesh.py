"""A mesh of int8 shards beside another model and another seed's checkpoint under the same name: it answers with
exactly the tokens one process gives with the same int8 weights (greedy), a killed int8 shard fails over to an int8
replica with identical tokens while neither a full-precision replica of the same range nor another seed's int8 shard
(both preferred by hop weight) is ever used, a scheme nobody serves is refused naming it, `llm.models` lists each
model by the weights the orchestrator holds with the schemes it is whole in, and a call naming no model is refused.

One mesh of real processes serves the module: int8 primaries p0-p2 over layers 0-1, 2-3, 4-5, an int8 replica r1 of
2-3 (hop_weight 2), a full-precision shard f1 of 2-3 (hop_weight 0.5: routing would take it first if schemes
could mix), an int8 shard s1 of every layer of another seed's `tiny-llama` (hop_weight 0.5: taken first if weights
could mix), and a shard q of every layer of a second model, `tiny-qwen` (another architecture); an orchestrator
without a local model. The kill test runs last."""

from __future__ import annotations

import signal

import pytest
import torch

from hearth.inference import SamplingParams, load_full, weights_sha256
from hearth.services.client.chat import list_models
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.protocol.chat import ChatParams, ChatRequest
from tests.e2e.conftest import TINY_CONTEXT_LENGTH, TINY_LAYERS, THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    MAX_TOKENS,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    PROMPT,
    REPLICA_WEIGHT,
    failover_mesh,
    nc,
    stream_with_action,
)
from tests.unit.inference_tiny_models import write_tiny_model

pytestmark = pytest.mark.timeout(600)
SECOND_MODEL = "tiny-qwen"


def request(quantization: str | None = None, model: str | None = TINY_MODEL_NAME) -> ChatRequest:
    return ChatRequest(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                       params=ChatParams(fallback_to_local=False, quantization=quantization))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    second_models = tmp_path_factory.mktemp("second-models")
    write_tiny_model(second_models / SECOND_MODEL, "qwen2", max_position_embeddings=TINY_CONTEXT_LENGTH)
    # Another seed under the same name: the mesh serves it as `tiny-llama`, with other weights.
    other_seed = write_tiny_model(tmp_path_factory.mktemp("other-seed") / TINY_MODEL_NAME, "llama", seed=1,
                                  max_position_embeddings=TINY_CONTEXT_LENGTH)
    with failover_mesh(tmp_path_factory, tiny_models_dir, "quantized-mesh") as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False,
                             extra_args=["--quantize", "int8"])
        lo, hi = THREE_SHARD_RANGES[1]
        mesh.start_shard("r1", lo, hi, hop_weight=REPLICA_WEIGHT, wait_ready=False, extra_args=["--quantize", "int8"])
        mesh.start_shard("f1", lo, hi, hop_weight=PREFERRED_WEIGHT, wait_ready=False)
        mesh.start_shard("s1", 0, TINY_LAYERS - 1, hop_weight=PREFERRED_WEIGHT, wait_ready=False,
                         extra_args=["--quantize", "int8"], model_path=other_seed)
        mesh.start_shard("q", 0, TINY_LAYERS - 1, hop_weight=PRIMARY_WEIGHT, wait_ready=False,
                         model_path=second_models / SECOND_MODEL)
        mesh.start_orchestrator(local_model=False, extra_args=["--models-dir", str(second_models),
                                                               "--preload", SECOND_MODEL])
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


def one_process_greedy_tokens(path, quantization: str, prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens of the whole model in one process with weights in `quantization`, one torch thread as every
    shard has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    local = load_full(path, quantization=quantization, **RUNNER_KV_LIMITS)
    try:
        prompt_ids = list(local.head.tokenizer(prompt)["input_ids"])
        return list(local.generate_ids(prompt_ids, SamplingParams(max_tokens=max_tokens)))
    finally:
        local.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def int8_reference(tiny_models_dir) -> list[int]:
    return one_process_greedy_tokens(tiny_models_dir / TINY_MODEL_NAME, "int8", PROMPT, MAX_TOKENS)


def test_adverts_carry_the_scheme_into_routing(mesh):
    assert mesh.routing_row("shards", mesh.shards["p1"].shard_id)["quantization"] == "int8"
    assert mesh.routing_row("shards", mesh.shards["f1"].shard_id)["quantization"] == "none"


async def test_an_int8_mesh_answers_with_the_tokens_of_int8_weights_in_one_process(mesh, int8_reference, nc):
    call = await stream_with_action(nc, request())
    assert call.final.type == "done", call.final
    assert call.first_hops == [mesh.shards[f"p{i}"].shard_id for i in range(3)]
    assert call.token_ids == int8_reference


@pytest.mark.parametrize("scheme", ["int4", "none"])
async def test_a_scheme_that_covers_nothing_whole_is_refused_naming_it(mesh, nc, scheme):
    call = await stream_with_action(nc, request(scheme))
    assert call.final.type == "pipeline_aborted", call.final
    assert call.final.code == "shard_unavailable"
    assert f"'{scheme}'" in call.final.reason and "\n" not in call.final.reason


async def test_llm_models_lists_each_model_by_our_weights_with_the_schemes_it_is_whole_in(mesh, tiny_models_dir, nc):
    listed = {model.id: model for model in (await list_models(nc, 10.0)).models}
    assert sorted(listed) == sorted([SECOND_MODEL, TINY_MODEL_NAME])
    ours = listed[TINY_MODEL_NAME]
    # Full precision covers 2-3 only; the other seed's int8 shard covers everything, but with other weights.
    assert ours.complete and ours.quantizations == ["int8"]
    assert ours.weights_sha256 == weights_sha256(tiny_models_dir / TINY_MODEL_NAME)
    assert listed[SECOND_MODEL].complete and listed[SECOND_MODEL].quantizations == ["none"]


async def test_each_model_is_served_by_its_own_shards_and_a_call_naming_none_is_refused(mesh, nc):
    second = await stream_with_action(nc, request(model=SECOND_MODEL))
    assert second.final.type == "done", second.final
    assert second.first_hops == [mesh.shards["q"].shard_id]
    unnamed = await stream_with_action(nc, request(model=None))
    assert (unnamed.final.type, unnamed.final.code, unnamed.final.param) == ("error", "bad_request", "model")
    assert SECOND_MODEL in unnamed.final.message and TINY_MODEL_NAME in unnamed.final.message


async def test_a_killed_int8_shard_fails_over_to_the_int8_replica_never_to_full_precision(mesh, int8_reference, nc):
    victim, replica, full_precision = mesh.shards["p1"], mesh.shards["r1"], mesh.shards["f1"]
    await mesh.wait_idle_in_routing(victim)
    call = await stream_with_action(nc, request(), lambda: victim.process.signal(signal.SIGKILL))

    assert call.final.type == "done", call.final
    failovers = call.of_type("shard_failover")
    assert len(failovers) == 1 and failovers[0].failed_shard_id == victim.shard_id, failovers
    assert replica.shard_id in failovers[0].replacement_hops
    assert full_precision.shard_id not in call.first_hops + failovers[0].replacement_hops
    assert mesh.shards["s1"].shard_id not in call.first_hops + failovers[0].replacement_hops
    assert call.token_ids == int8_reference

"""Failover with quantized layers keeps the uninterrupted run's every bit: an int8 (and an int4) mesh of a model whose
attention heads have 64 dimensions, its middle shard killed after 12 greedy tokens, goes on over its replica with
the tokens and the log-probabilities (compared exactly) of an uninterrupted call; so does a GGUF mixed as
llama.cpp's Q4_K_M mixes a model, served as it stores it (its 4-bit blocks in int4, its more precise matrices in
int8: hearth/inference/held_forms.py), because the re-prefill sends the
tokens already decoded as replay steps (hearth/services/orchestrator/prefill.py).

Why this model: the prompt and the replayed tokens sit past 32 positions, where a prefill's attention sums its keys
in another order than a decode step's one query; the tiny test model's 16-dimension heads never show that, and an
int8 layer rounds such a difference up to a whole level of its activations. Replayed as prefill chunks instead, the
log-probabilities after the failover part from the uninterrupted call's."""

from __future__ import annotations

import signal

import pytest
from gguf import GGMLQuantizationType

from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.protocol.chat_frames import TokenDeltaFrame
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_LAYERS
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    failover_mesh,
    nc,
    stream_with_action,
)
from tests.unit.gguf_files import q4_k_m_like, write_tiny_gguf
from tests.unit.inference_tiny_models import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL_NAME = "wide-heads-llama"
# The same shape as a GGUF mix: a folder holding one GGUF is served by the folder's name.
MIX_MODEL_NAME = "wide-heads-llama-mix"
WIDE_HEADS = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=TINY_LAYERS)
# About 60 prompt tokens with the tiny tokenizer: every replayed position lies past 32.
PROMPT = "the quick brown fox jumps over the lazy dog; hearth runs one model across the machines of a community"
MAX_TOKENS = 32
KILL_AFTER_TOKENS = 12


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide-heads-models")
    write_tiny_model(folder / MODEL_NAME, "llama", **WIDE_HEADS)
    source, _ = write_tiny_gguf(tmp_path_factory.mktemp("wide-heads-gguf"), "llama", GGMLQuantizationType.F32,
                                **WIDE_HEADS)
    (folder / MIX_MODEL_NAME).mkdir()
    # The middle shard's layers (2-3) hold both forms.
    q4_k_m_like(source, folder / MIX_MODEL_NAME / "mix.gguf", more_bits_layers=(2,))
    return folder


@pytest.fixture(scope="module", params=[("int8", MODEL_NAME), ("int4", MODEL_NAME), ("auto", MIX_MODEL_NAME)],
                ids=["int8", "int4", "gguf-mix"])
def mesh(request, tmp_path_factory, models_dir):
    quantize, model_name = request.param
    scheme = ["--quantize", quantize, "--device", "cpu"]  # a GPU runs a replay as a prefill
    with failover_mesh(tmp_path_factory, models_dir, f"replay-mesh-{quantize}", model_name=model_name) as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False, extra_args=scheme)
        lo, hi = THREE_SHARD_RANGES[1]
        mesh.start_shard("r1", lo, hi, hop_weight=REPLICA_WEIGHT, wait_ready=False, extra_args=scheme)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


def request(model_name: str) -> ChatRequest:
    return ChatRequest(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True,
                       params=ChatParams(fallback_to_local=False))


def logprobs(call) -> list[float]:
    return [frame.logprobs.logprob for frame in call.frames if isinstance(frame, TokenDeltaFrame)]


async def test_a_quantized_failover_continues_with_the_uninterrupted_calls_tokens_and_logprobs(mesh, nc):
    victim, replica = mesh.shards["p1"], mesh.shards["r1"]
    uninterrupted = await stream_with_action(nc, request(mesh.model_name))
    assert uninterrupted.final.type == "done", uninterrupted.final
    assert uninterrupted.first_hops == [mesh.shards[f"p{i}"].shard_id for i in range(3)]
    assert len(uninterrupted.token_ids) > KILL_AFTER_TOKENS + 4, "the model ended before the failover could matter"

    await mesh.wait_idle_in_routing(victim)
    failed_over = await stream_with_action(nc, request(mesh.model_name), lambda: victim.process.signal(signal.SIGKILL),
                                           after_tokens=KILL_AFTER_TOKENS)

    assert failed_over.final.type == "done", failed_over.final
    failovers = failed_over.of_type("shard_failover")
    assert len(failovers) == 1 and replica.shard_id in failovers[0].replacement_hops, failovers
    assert failed_over.token_ids == uninterrupted.token_ids
    assert logprobs(failed_over) == logprobs(uninterrupted)

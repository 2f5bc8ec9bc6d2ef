"""Continuous batching on shards and in the orchestrator's head over real processes: 8 concurrent greedy sessions
through 3 shard hosts give generate()'s tokens (each session's solo output) while the shards run their decode steps
(and their short prefills) and the orchestrator its head steps (final norm + lm_head) in batches; sessions joining
and leaving mid-batch leave the others unchanged and a seeded sampled session its solo tokens; a shard SIGKILLed
mid-batch fails over to its replica with identical output for every session.

One mesh serves the module: primaries p0-p2 and replicas r0-r2 over layers 0-1, 2-3, 4-5, each serving up to 8
hops, and an orchestrator; the tests run in file order (the second kills p1)."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.protocol.chat import ChatParams, ChatRequest
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    failover_mesh,
    nc,
    scrape_metric,
    stream_with_action,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SESSIONS = 8
NEW_TOKENS = 16
PROMPTS = ["the lazy dog", "a community mesh", "hello there, how can I help", "hi", "one model across machines",
           "the quick brown fox jumps over the lazy dog", "grüße aus köln", "café"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    env = {"HEARTH_SHARD__MAX_CONCURRENT_STREAMS": str(SESSIONS), "HEARTH_SHARD__MAX_BATCH_SESSIONS": str(SESSIONS),
           "HEARTH_ORCHESTRATOR__HEAD_BATCH_SESSIONS": str(SESSIONS)}
    with failover_mesh(tmp_path_factory, tiny_models_dir, "batching", extra_env=env) as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False)
            mesh.start_shard(f"r{index}", lo, hi, hop_weight=REPLICA_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


@pytest.fixture(scope="module")
def expected(tiny_models_dir) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from the monolithic model: what a session gives alone."""
    path = tiny_models_dir / TINY_MODEL_NAME
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            output = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            tokens[prompt] = output[0, len(ids):].tolist()
    return tokens


def request(prompt: str, max_tokens: int = NEW_TOKENS) -> ChatRequest:
    # Unchecked: a check's mirror would run its own prefill steps on a replica, and this counts the calls' own.
    return ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                       params=ChatParams(verify="none"))


def seeded_request() -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95,
                       seed=4321)


def head_batch_figures(mesh) -> tuple[float, float]:
    """Head batches the orchestrator ran and the rows in them."""
    port = mesh.orchestrator.metrics_port
    return (scrape_metric(port, "hearth_head_batches_total", {}),
            scrape_metric(port, "hearth_head_batch_rows_total", {}))


def batch_figures(mesh, kind: str = "decode") -> tuple[float, float]:
    """Batched steps of `kind` and the rows in them, over every live shard."""
    batches = rows = 0.0
    for handle in mesh.live_shards():
        labels = {"shard_id": handle.shard_id}
        batches += scrape_metric(handle.process.metrics_port, f"hearth_shard_{kind}_batches_total", labels)
        rows += scrape_metric(handle.process.metrics_port, f"hearth_shard_{kind}_batch_rows_total", labels)
    return batches, rows


async def test_eight_concurrent_sessions_are_batched_and_give_their_solo_tokens(mesh, expected, nc):
    calls = await asyncio.gather(*(stream_with_action(nc, request(prompt)) for prompt in PROMPTS))
    for prompt, call in zip(PROMPTS, calls, strict=True):
        assert call.final.type == "done", call.final
        assert call.token_ids == expected[prompt], prompt
    batches, rows = batch_figures(mesh)
    assert batches > 0 and rows > batches  # some decode steps ran several sessions at once
    prefill_batches, prefill_rows = batch_figures(mesh, "prefill")
    # The short prompts went through the shards' batchers too (several per batch when they arrived together).
    assert prefill_batches > 0 and SESSIONS * len(THREE_SHARD_RANGES) == prefill_rows
    head_batches, head_rows = head_batch_figures(mesh)
    assert head_batches > 0 and head_rows > head_batches  # and some head steps


async def test_sessions_joining_and_leaving_mid_batch_and_seeded_sampling_keep_their_solo_tokens(mesh, expected, nc):
    alone = await stream_with_action(nc, seeded_request())
    assert alone.final.type == "done" and len(alone.token_ids) == NEW_TOKENS
    head_rows_before = head_batch_figures(mesh)[1]
    # Three greedy sessions join once the first has 3 tokens; the sessions leave after 4, 8, ... tokens.
    lengths = {prompt: 4 * (1 + index % 4) for index, prompt in enumerate(PROMPTS[2:])}
    joiners: list[asyncio.Task] = []

    def join() -> None:
        joiners.extend(asyncio.create_task(stream_with_action(nc, request(prompt, lengths[prompt])))
                       for prompt in PROMPTS[5:])

    first_ones = [stream_with_action(nc, request(PROMPTS[2], lengths[PROMPTS[2]]), join, after_tokens=3)]
    first_ones += [stream_with_action(nc, request(prompt, lengths[prompt])) for prompt in PROMPTS[3:5]]
    seeded, *calls = await asyncio.gather(stream_with_action(nc, seeded_request()), *first_ones)
    calls += await asyncio.gather(*joiners)
    assert seeded.final.type == "done" and seeded.token_ids == alone.token_ids
    for prompt, call in zip(PROMPTS[2:], calls, strict=True):
        assert call.final.type == "done", call.final
        assert call.token_ids == expected[prompt][:lengths[prompt]], prompt
    assert head_batch_figures(mesh)[1] > head_rows_before


async def test_a_shard_killed_mid_batch_fails_over_with_identical_output_for_every_session(mesh, expected, nc):
    victim = mesh.shards["p1"]
    await mesh.wait_idle_in_routing(victim)
    killed = asyncio.Event()

    def kill() -> None:
        if not killed.is_set():
            killed.set()
            victim.process.signal(signal.SIGKILL)

    calls = await asyncio.gather(*(stream_with_action(nc, request(prompt), kill if index == 0 else None)
                                   for index, prompt in enumerate(PROMPTS)))
    assert killed.is_set()
    for prompt, call in zip(PROMPTS, calls, strict=True):
        assert call.final.type == "done", call.final
        assert call.token_ids == expected[prompt], prompt
    assert any(call.of_type("shard_failover") for call in calls)

"""Kept prefixes over real processes: a conversation's next turn prefills only what its hops do not hold yet and its
greedy tokens stay generate()'s; an edited history, and a hop that dropped its kept blocks, prefill everything again
and still answer right."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from hearth.services.devtools.local_cluster import LocalCluster
from tests.e2e.conftest import (
    THREE_SHARD_RANGES,
    TINY_MODEL_NAME,
    chat_once,
    greedy_reference,
    start_orchestrator,
)
from tests.e2e.failover_support import pipeline_events

pytestmark = pytest.mark.e2e

BLOCK = 8
NEW_TOKENS = 6
FIRST_TURN = ("a community of households shares one model across its machines, each holding a few layers of it, "
              "and every call streams activations from one house to the next")


def start_mesh(cluster: LocalCluster, models_dir, shard_env: list[dict[str, str]]) -> None:
    for index, ((lo, hi), env) in enumerate(zip(THREE_SHARD_RANGES, shard_env)):
        cluster.extra_env.update(env)
        cluster.start_shard(str(models_dir / TINY_MODEL_NAME), lo, hi, node_id=f"host{index}", wait_ready=False)
        for key in env:  # read when the process starts: the next one does not get it
            cluster.extra_env.pop(key)
    start_orchestrator(cluster, models_dir, env={"HEARTH_PREFIX_CACHE__BLOCK_TOKENS": str(BLOCK)})
    cluster.wait_all_ready()


async def ask_constructed(cluster: LocalCluster, models_dir, prompt: str):
    """The call's text (its greedy tokens checked against generate()'s) and its `pipeline.constructed` event."""
    result = await chat_once(cluster, ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=NEW_TOKENS))
    assert result.ok, result.final
    expected = await asyncio.to_thread(greedy_reference, models_dir / TINY_MODEL_NAME, prompt, NEW_TOKENS)
    assert result.token_ids == expected
    nc = await connect_nats(cluster.nats_url, name="e2e-events", settings=cluster.nats_settings())
    try:
        events = await pipeline_events(nc, result.frames_of("pipeline")[0].pipeline_id)
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    return result.text, next(item.event for item in events if item.event.type == "pipeline.constructed")


async def ask(cluster: LocalCluster, models_dir, prompt: str) -> tuple[str, int]:
    """The call's text (greedy tokens checked) and the prompt positions its hops already held."""
    text, constructed = await ask_constructed(cluster, models_dir, prompt)
    return text, constructed.cached_prompt_tokens


async def test_a_conversation_s_next_turn_prefills_only_its_new_part(cluster, tiny_models_dir):
    start_mesh(cluster, tiny_models_dir, [{}, {}, {}])
    answer, cached = await ask(cluster, tiny_models_dir, FIRST_TURN)
    assert cached == 0
    second_turn = FIRST_TURN + answer + " and then the next house answers with what it knows"
    _, cached = await ask(cluster, tiny_models_dir, second_turn)
    first_turn_tokens = len(AutoTokenizer.from_pretrained(tiny_models_dir / TINY_MODEL_NAME)(FIRST_TURN)["input_ids"])
    assert cached % BLOCK == 0 and cached >= (first_turn_tokens // BLOCK - 1) * BLOCK, cached
    # A client that edits an earlier turn shares no block with it: everything is prefilled, and the answer is right.
    _, cached = await ask(cluster, tiny_models_dir, "one" + second_turn[1:])
    assert cached == 0


async def test_a_hop_that_dropped_its_kept_blocks_makes_the_call_prefill_everything(cluster, tiny_models_dir):
    # The middle host keeps blocks for a moment only: by the next call they are gone there, whatever the others hold.
    start_mesh(cluster, tiny_models_dir, [{}, {"HEARTH_SHARD__PREFIX_CACHE_IDLE_S": "0.2"}, {}])
    answer, _ = await ask(cluster, tiny_models_dir, FIRST_TURN)
    await asyncio.sleep(1.0)
    _, cached = await ask(cluster, tiny_models_dir, FIRST_TURN + answer + " and more")
    assert cached == 0


async def test_a_request_s_choices_share_its_prompt_s_prefill(cluster, tiny_models_dir):
    start_mesh(cluster, tiny_models_dir, [{}, {}, {}])
    request = ChatRequest(model=TINY_MODEL_NAME, prompt=FIRST_TURN, max_tokens=NEW_TOKENS, n=3, temperature=0.9,
                          seed=7)
    result = await chat_once(cluster, request)
    assert result.ok, result.final
    done = result.final
    assert [end.choice for end in done.choices] == [0, 1, 2]
    per_choice = {index: [f.token_id for f in result.frames_of("token_delta") if f.choice == index]
                  for index in range(3)}
    assert all(len(ids) == end.completion_tokens > 0 for ids, end in zip(per_choice.values(), done.choices))
    assert done.usage.completion_tokens == sum(end.completion_tokens for end in done.choices)
    # Each choice is a pipeline of its own; the later ones began from the first one's kept prompt blocks.
    pipelines = {frame.choice: frame.pipeline_id for frame in result.frames_of("pipeline")}
    assert sorted(pipelines) == [0, 1, 2] and len(set(pipelines.values())) == 3
    nc = await connect_nats(cluster.nats_url, name="e2e-events", settings=cluster.nats_settings())
    try:
        cached = {}
        for choice, pipeline_id in pipelines.items():
            events = await pipeline_events(nc, pipeline_id)
            cached[choice] = next(item.event.cached_prompt_tokens for item in events
                                  if item.event.type == "pipeline.constructed")
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    prompt_tokens = done.usage.prompt_tokens
    assert cached[0] == 0 and all(cached[c] == (prompt_tokens - 1) // BLOCK * BLOCK for c in (1, 2)), cached
    # The same request again draws the same choices (choice i with seed + i), and a greedy pair is the n=1 answer.
    again = await chat_once(cluster, request)
    assert [[f.token_id for f in again.frames_of("token_delta") if f.choice == c] for c in range(3)] == \
        list(per_choice.values())
    greedy, _ = await ask(cluster, tiny_models_dir, FIRST_TURN)
    pair = await chat_once(cluster, ChatRequest(model=TINY_MODEL_NAME, prompt=FIRST_TURN, max_tokens=NEW_TOKENS,
                                                n=2))
    assert [''.join(f.text for f in pair.frames_of("token_delta") if f.choice == c) for c in (0, 1)] == [greedy] * 2

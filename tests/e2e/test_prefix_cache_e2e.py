"""Kept prefixes over real processes: a conversation's next turn prefills only what its hops do not hold yet and its
greedy tokens stay generate()'s; an edited history, and a hop that dropped its kept blocks, prefill everything again
and still answer right."""

from __future__ import annotations

import asyncio
import re
import time

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
from tests.e2e.prometheus_support import scrape

pytestmark = pytest.mark.e2e

BLOCK = 8
NEW_TOKENS = 6
FIRST_TURN = ("a community of households shares one model across its machines, each holding a few layers of it, "
              "and every call streams activations from one house to the next")


def start_mesh(cluster: LocalCluster, models_dir, shard_env: list[dict[str, str]],
               orchestrator_env: dict[str, str] | None = None):
    """Three hosts and an orchestrator (returned) naming blocks of BLOCK tokens."""
    for index, ((lo, hi), env) in enumerate(zip(THREE_SHARD_RANGES, shard_env)):
        cluster.extra_env.update(env)
        cluster.start_shard(str(models_dir / TINY_MODEL_NAME), lo, hi, node_id=f"host{index}", wait_ready=False)
        for key in env:  # read when the process starts: the next one does not get it
            cluster.extra_env.pop(key)
    orchestrator = start_orchestrator(cluster, models_dir, env={"HEARTH_PREFIX_CACHE__BLOCK_TOKENS": str(BLOCK),
                                                                **(orchestrator_env or {})})
    cluster.wait_all_ready()
    return orchestrator


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


# A first turn long enough that its answer fills whole blocks past the prompt's. The tiny model answers random
# bytes, which tokenize again as they were sampled only for a few tokens: after this prompt, far enough to close
# a block past the prompt's.
ANSWER_TOKENS = 20
WARM_FIRST_TURN = FIRST_TURN + ". "
WARM_UP_WAIT_S = 60.0


async def warm_ups(orchestrator, outcome: str, at_least: int = 1) -> int:
    """`hearth_answer_warm_ups_total{outcome}` of the orchestrator once it reached `at_least`."""
    deadline = time.monotonic() + WARM_UP_WAIT_S
    pattern = re.compile(rf'^hearth_answer_warm_ups_total{{outcome="{outcome}"}} (\S+)$', re.MULTILINE)
    while True:
        found = pattern.search(await asyncio.to_thread(scrape, orchestrator.metrics_url))
        count = int(float(found.group(1))) if found else 0
        if count >= at_least or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.2)


async def first_turn(cluster, models_dir):
    """A conversation's first turn (its greedy tokens checked)."""
    result = await chat_once(cluster, ChatRequest(model=TINY_MODEL_NAME, prompt=WARM_FIRST_TURN,
                                                  max_tokens=ANSWER_TOKENS))
    assert result.ok, result.final
    expected = await asyncio.to_thread(greedy_reference, models_dir / TINY_MODEL_NAME, WARM_FIRST_TURN,
                                       ANSWER_TOKENS)
    assert result.token_ids == expected
    return result


def shared_blocks(models_dir, first_turn_ids: list[int], answer_ids: list[int], second_turn: str) -> tuple[int, int]:
    """Positions of the first turn's prompt's whole blocks, and of the whole blocks of what the first turn ran that
    the next turn's prompt begins with (before its last token)."""
    tokenizer = AutoTokenizer.from_pretrained(models_dir / TINY_MODEL_NAME)
    second_ids = tokenizer(second_turn)["input_ids"]
    ran = first_turn_ids + answer_ids[:-1]
    common = 0
    for ours, theirs in zip(ran, second_ids[:-1]):
        if ours != theirs:
            break
        common += 1
    return len(first_turn_ids) // BLOCK * BLOCK, common // BLOCK * BLOCK


async def test_after_its_answer_s_warm_up_a_next_turn_computes_only_its_new_tokens(cluster, tiny_models_dir):
    # The answer's positions were decode steps, whose KV is not a prefill's: the call keeps its prompt's blocks, and
    # its answer's are prefilled again in the background and kept; the next turn, sent at once, waits for that and
    # then computes only what is new.
    orchestrator = start_mesh(cluster, tiny_models_dir, [{}, {}, {}])
    first = await chat_once(cluster, ChatRequest(model=TINY_MODEL_NAME, prompt=WARM_FIRST_TURN,
                                                 max_tokens=ANSWER_TOKENS))
    assert first.ok, first.final
    second_turn = WARM_FIRST_TURN + first.text + " and then the next house answers with what it knows"
    _, cached = await ask(cluster, tiny_models_dir, second_turn)
    assert await warm_ups(orchestrator, "kept") >= 1  # the first turn's, and maybe the second's already
    assert first.token_ids == await asyncio.to_thread(greedy_reference, tiny_models_dir / TINY_MODEL_NAME,
                                                      WARM_FIRST_TURN, ANSWER_TOKENS)
    first_ids = AutoTokenizer.from_pretrained(tiny_models_dir / TINY_MODEL_NAME)(WARM_FIRST_TURN)["input_ids"]
    prompt_blocks, shared = shared_blocks(tiny_models_dir, first_ids, first.token_ids, second_turn)
    assert shared > prompt_blocks and cached == shared, (cached, prompt_blocks, shared)


async def test_an_answer_whose_warm_up_fails_leaves_its_prompt_s_blocks_kept(cluster, tiny_models_dir):
    # A warm-up that cannot finish in time keeps nothing of its own: the next turn begins from the prompt's blocks
    # (computed by a prefill) and still answers what a whole prefill does.
    orchestrator = start_mesh(cluster, tiny_models_dir, [{}, {}, {}],
                              orchestrator_env={"HEARTH_PREFIX_CACHE__WARM_UP_TIMEOUT_S": "0.001"})
    first = await first_turn(cluster, tiny_models_dir)
    assert await warm_ups(orchestrator, "failed") == 1
    assert await warm_ups(orchestrator, "kept", at_least=0) == 0
    second_turn = WARM_FIRST_TURN + first.text + " and then the next house answers with what it knows"
    _, cached = await ask(cluster, tiny_models_dir, second_turn)
    first_ids = AutoTokenizer.from_pretrained(tiny_models_dir / TINY_MODEL_NAME)(WARM_FIRST_TURN)["input_ids"]
    prompt_blocks, shared = shared_blocks(tiny_models_dir, first_ids, first.token_ids, second_turn)
    assert cached == min(prompt_blocks, shared) and shared > prompt_blocks, (cached, prompt_blocks, shared)

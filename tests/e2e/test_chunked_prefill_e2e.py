"""Chunked prefill through real processes, with an orchestrator that prefills one token per step (pipelined through
three hops): a short call sent while a long prompt prefills is answered in full before the long prompt's first
token (the shards serve the steps of both sessions in arrival order, and the orchestrator sends each call's steps
without waiting for the other's); a shard failing mid-prefill (its third prefill step raises) is failed over and the
prompt re-prefilled, with identical output."""

from __future__ import annotations

import asyncio
import time

import pytest

from hearth.services.client.chat import stream_chat
from hearth.protocol.chat import ChatRequest
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    MAX_TOKENS,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    failover_mesh,
    nc,
    stream_with_action,
    wait_until_released,
)

pytestmark = pytest.mark.timeout(300)

# Not in the tiny tokenizer's corpus, so it stays many tokens: many one-token chunks.
PROMPT = "zebras quietly vex jumpy wizards at dawn"
FAULTY_AFTER_STEPS = 2
# About 420 tokens: 420 one-token prefill steps through every hop.
LONG_PROMPT = (PROMPT + " ") * 12


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    env = {"HEARTH_ORCHESTRATOR__PREFILL_CHUNK_TOKENS": "1"}
    with failover_mesh(tmp_path_factory, tiny_models_dir, "chunked-prefill", extra_env=env) as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"h{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


def request(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0)


async def test_a_short_call_is_answered_while_a_long_prompt_prefills(mesh, nc):
    prefilling = asyncio.Event()
    long_first_token_at: list[float] = []

    async def long_call() -> str:
        final = None
        async for frame in stream_chat(nc, request(LONG_PROMPT, max_tokens=2), first_frame_timeout=60.0):
            if frame.type == "pipeline":
                prefilling.set()
            if frame.type == "token_delta" and not long_first_token_at:
                long_first_token_at.append(time.monotonic())
            final = frame
        return final.type

    long_task = asyncio.create_task(long_call())
    await asyncio.wait_for(prefilling.wait(), timeout=60.0)
    short = await stream_with_action(nc, request("ok", max_tokens=2))
    short_done_at = time.monotonic()
    assert short.final.type == "done" and len(short.token_ids) == 2, short.final
    assert await asyncio.wait_for(long_task, timeout=120.0) == "done"
    assert long_first_token_at and short_done_at < long_first_token_at[0]


async def test_a_shard_failing_mid_prefill_is_failed_over_with_identical_output(mesh, nc):
    reference = await stream_with_action(nc, request())
    assert reference.final.type == "done" and len(reference.token_ids) == MAX_TOKENS, reference.final
    assert reference.final.usage.prompt_tokens > FAULTY_AFTER_STEPS + 2  # the fault lands inside the prefill

    lo, hi = THREE_SHARD_RANGES[1]
    failing = await asyncio.to_thread(mesh.start_shard, "x-fail", lo, hi, hop_weight=PREFERRED_WEIGHT,
                                      fault=f"after_steps={FAULTY_AFTER_STEPS},fail")
    try:
        await mesh.wait_advertised(failing)
        call = await stream_with_action(nc, request())
        assert failing.shard_id in call.first_hops
        assert call.final.type == "done", call.final
        failovers = call.of_type("shard_failover")
        assert [(f.failed_shard_id, f.resumed_at_token) for f in failovers] == [(failing.shard_id, 0)]
        assert call.token_ids == reference.token_ids
    finally:
        await asyncio.to_thread(mesh.stop_shard, failing)
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats

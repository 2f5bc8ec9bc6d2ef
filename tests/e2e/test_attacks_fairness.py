"""Attacks on the fairness of admission over a real secure mesh (issue 26, items 4 and 8): one member floods the
orchestrator with more long-prompt calls than its queue holds, and another member's call is still admitted at
once and done; the flooder is held to its shares (one running place fewer than the total, its part of the
queue) and gets `overloaded` beyond them, and its prompts are tokenized only when their turn comes.

One mesh serves the module: three shards of the tiny model and an orchestrator running 2 calls at once (the
per-caller limit 2 would let one member take both), with 6 places in its queue and 3 for each member."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.client.chat import ChatResult, stream_chat
from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.protocol.chat_frames import ErrorFrame
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_CONTEXT_LENGTH, TINY_MODEL_NAME, three_shard_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_RUNNING = 2
PER_CALLER = 2
MAX_QUEUED = 6
QUEUED_PER_CALLER = 3
RETRY_AFTER_S = 4.0
FLOOD = 12
# About 560 tokens of the tiny model's tokenizer: long, but with LONG_TOKENS it fits the context of 1024.
LONG_PROMPT = " ".join("hearth runs one model across the machines of a community mesh".split()[i % 11]
                       for i in range(200))
LONG_TOKENS = 300
# Far beyond the context: refused from the lower bound on its tokens once tokenizing is its turn.
TOO_LONG_PROMPT = "x " * 50_000
PATIENT = {"first_frame_timeout": 60.0, "frame_gap_timeout": 30.0}
FIRST_FRAMES_WITHIN_S = 90.0
TOO_LONG_MESSAGE = re.compile(r"fields 'prompt' and 'max_tokens': the prompt's (at least )?\d+ tokens plus max_tokens "
                              rf"\d+ exceed the model's context of {TINY_CONTEXT_LENGTH} tokens")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    env = {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__MAX_CONCURRENT_PIPELINES": str(MAX_RUNNING),
           "HEARTH_ORCHESTRATOR__MAX_STREAMS_PER_CALLER": str(PER_CALLER),
           "HEARTH_ORCHESTRATOR__MAX_QUEUED_REQUESTS": str(MAX_QUEUED),
           "HEARTH_ORCHESTRATOR__MAX_QUEUED_PER_CALLER": str(QUEUED_PER_CALLER),
           "HEARTH_ORCHESTRATOR__OVERLOADED_RETRY_AFTER_S": str(RETRY_AFTER_S)}
    with three_shard_mesh(tmp_path_factory.mktemp("fairness"), tiny_models_dir, extra_env=env) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def member(cluster: LocalCluster, name: str):
    nc = await connect_nats(cluster.nats_url, name=f"fairness-{name}",
                            settings=cluster.nats_settings(cluster.member_key(name, "client")))
    try:
        yield nc
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


def call(prompt: str, max_tokens: int) -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                       params=ChatParams(fallback_to_local=False))


class Watched:
    """A call streamed in the background: its frames so far, and an event set at its first frame."""

    def __init__(self, nc, request: ChatRequest) -> None:
        self.result = ChatResult()
        self.first_frame = asyncio.Event()
        self.task = asyncio.create_task(self._run(nc, request))

    async def _run(self, nc, request: ChatRequest) -> ChatResult:
        async with contextlib.aclosing(stream_chat(nc, request, **PATIENT)) as frames:
            async for frame in frames:
                self.result.frames.append(frame)
                self.first_frame.set()
        return self.result

    @property
    def first(self):
        return self.result.frames[0]


async def first_frames(calls: list[Watched]) -> None:
    await asyncio.wait_for(asyncio.gather(*(c.first_frame.wait() for c in calls)), timeout=FIRST_FRAMES_WITHIN_S)


async def stop(calls: list[Watched]) -> None:
    """Leave: each call's inbox is unsubscribed, and the orchestrator ends what still runs or waits."""
    for watched in calls:
        watched.task.cancel()
    await asyncio.gather(*(c.task for c in calls), return_exceptions=True)


async def test_a_flooding_member_is_held_to_its_shares_while_another_members_call_is_done(mesh):
    async with member(mesh, "flooder") as flooder, member(mesh, "neighbour") as neighbour:
        flood = [Watched(flooder, call(LONG_PROMPT, LONG_TOKENS)) for _ in range(FLOOD)]
        try:
            await first_frames(flood)
            firsts = [w.first for w in flood]
            # It runs one call fewer than the total and waits with its share of the queue; the rest is refused.
            assert [f.type for f in firsts].count("pipeline") == MAX_RUNNING - 1, firsts
            assert [f.type for f in firsts].count("queued") <= QUEUED_PER_CALLER, firsts
            refused = [f for f in firsts if f.type == "error"]
            assert refused, firsts
            for frame in refused:
                assert isinstance(frame, ErrorFrame) and frame.code == "overloaded", frame
                assert frame.retry_after_s == RETRY_AFTER_S and "max_queued_per_caller" in frame.message, frame
            # Its prompt is not tokenized before its turn: beyond its share even an unservable prompt is
            # answered `overloaded`, not checked.
            beyond = Watched(flooder, call(TOO_LONG_PROMPT, 8))
            final = (await beyond.task).final
            assert isinstance(final, ErrorFrame) and final.code == "overloaded", final
            # The other member's call is admitted at once and completes.
            answer = Watched(neighbour, call("The kitchen fire", 8))
            result = await answer.task
            assert result.ok, result.final
            assert not result.frames_of("queued"), result.frames[:3]
            assert not all(w.task.done() for w in flood), "the flood ended before the other call: not a test"
        finally:
            await stop(flood)


async def test_a_prompt_is_checked_when_its_turn_comes_with_the_same_refusal(mesh):
    async with member(mesh, "patient") as patient:
        running = Watched(patient, call("Once upon a time", 24))
        try:
            await first_frames([running])
            assert running.first.type == "pipeline", running.first
            # At its running share: the next call waits its turn before its prompt is tokenized and refused.
            result = await Watched(patient, call(TOO_LONG_PROMPT, 8)).task
            assert result.frames[0].type == "queued", result.frames[:2]
            final = result.final
            assert isinstance(final, ErrorFrame) and final.code == "bad_request", final
            assert TOO_LONG_MESSAGE.fullmatch(final.message), final.message
            assert (await running.task).ok
        finally:
            await stop([running])

"""Admission with real processes (docs/protocol.md "Admission"): a burst of 50 calls all complete with the text
of a solo greedy run, waiting calls are told their place, calls beyond the queue's bound are `overloaded` with
`retry_after_s`, one caller's limit does not hold back another caller, and a shard answering `at_capacity`
makes a call try a replica or wait instead of failing.

One mesh serves the first tests (three shards of the tiny model, one orchestrator running 4 calls at once and 2
per caller, with room for 48 waiting calls); the at_capacity test has its own small mesh."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from hearth.inference import weights_sha256
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.client.chat import ChatResult, chat, stream_chat
from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.protocol.chat_frames import ErrorFrame, QueuedFrame
from hearth.protocol.control import CloseHop, OpenHop
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator, three_shard_mesh
from tests.e2e.failover_support import ShardHandle, open_hop_as_orchestrator

pytestmark = [pytest.mark.timeout(300), pytest.mark.scheduled_first]

BURST = 50
MAX_RUNNING = 4
PER_CALLER = 2
# One caller's burst of BURST fits exactly: PER_CALLER running, the rest waiting.
MAX_QUEUED = BURST - PER_CALLER
RETRY_AFTER_S = 7.0
# The client waits this long for a first frame or between frames (a burst keeps the machine busy).
PATIENT = {"first_frame_timeout": 60.0, "frame_gap_timeout": 30.0}


def greedy(max_tokens: int = 4, prompt: str = "The kitchen fire") -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                       params=ChatParams(fallback_to_local=False))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    env = {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__MAX_CONCURRENT_PIPELINES": str(MAX_RUNNING),
           "HEARTH_ORCHESTRATOR__MAX_STREAMS_PER_CALLER": str(PER_CALLER),
           "HEARTH_ORCHESTRATOR__MAX_QUEUED_REQUESTS": str(MAX_QUEUED),
           # One caller may take the whole queue here (tests/e2e/test_attacks_fairness.py tests the shares).
           "HEARTH_ORCHESTRATOR__MAX_QUEUED_PER_CALLER": str(MAX_QUEUED),
           "HEARTH_ORCHESTRATOR__OVERLOADED_RETRY_AFTER_S": str(RETRY_AFTER_S)}
    with three_shard_mesh(tmp_path_factory.mktemp("admission"), tiny_models_dir, extra_env=env) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def connected(cluster: LocalCluster, member: str | None = None):
    creds = cluster.member_key(member, "client") if member else None
    nc = await connect_nats(cluster.nats_url, name=f"admission-{member or 'system'}",
                            settings=cluster.nats_settings(creds))
    try:
        yield nc
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


async def test_a_burst_of_50_all_complete_with_the_solo_text_and_waiting_calls_see_their_place(mesh):
    async with connected(mesh) as nc:
        solo = await chat(nc, greedy(), **PATIENT)
        assert solo.ok, solo.final
        results = await asyncio.gather(*(chat(nc, greedy(), **PATIENT) for _ in range(BURST)))
    refused = [r.final for r in results if not r.ok]
    assert not refused, refused
    assert all(r.token_ids == solo.token_ids and r.text == solo.text for r in results)
    queued = [r for r in results if r.frames_of("queued")]
    # One caller may run PER_CALLER calls: all the others waited, and were told their place until it was 1.
    assert len(queued) >= BURST - MAX_RUNNING
    for result in queued:
        positions = [f.position for f in result.frames_of("queued")]
        assert positions == sorted(positions, reverse=True) and positions[-1] == 1, positions
        assert result.frames[0].type == "queued"
        assert result.final.timing.queue_wait_ms > 0


async def test_beyond_the_bound_calls_are_overloaded_with_retry_after(mesh):
    extra = 12
    async with connected(mesh) as nc:
        results = await asyncio.gather(*(chat(nc, greedy(), **PATIENT) for _ in range(BURST + extra)))
    overloaded = [r.final for r in results if not r.ok]
    assert overloaded, "every call fitted: the bound was not reached"
    for frame in overloaded:
        assert isinstance(frame, ErrorFrame) and frame.code == "overloaded", frame
        assert frame.retry_after_s == RETRY_AFTER_S and frame.seq == 0
    # Calls finishing while the burst arrived make room for a few more, never for all of them.
    assert len(overloaded) <= extra


async def first_frame_other_than_keepalive(frames) -> object:
    async for frame in frames:
        return frame
    raise AssertionError("the stream ended without a frame")


async def run_until_started(nc, request: ChatRequest, started: asyncio.Event) -> ChatResult:
    """The whole call; `started` is set when its pipeline frame arrives."""
    result = ChatResult()
    async with contextlib.aclosing(stream_chat(nc, request, **PATIENT)) as frames:
        async for frame in frames:
            result.frames.append(frame)
            if frame.type == "pipeline":
                started.set()
    return result


async def test_a_caller_at_its_limit_waits_while_another_caller_starts(mesh):
    long_call = greedy(max_tokens=120, prompt="Once upon a time")
    async with connected(mesh, "alice") as alice, connected(mesh, "bob") as bob:
        started = [asyncio.Event() for _ in range(PER_CALLER)]
        running = [asyncio.create_task(run_until_started(alice, long_call, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=60)
        async with contextlib.aclosing(stream_chat(alice, long_call, **PATIENT)) as third:
            # alice's third call waits although the orchestrator could run more: alice is at her own limit...
            frame = await first_frame_other_than_keepalive(third)
            assert isinstance(frame, QueuedFrame) and frame.position == 1, frame
            # ...while bob's call starts at once.
            bobs: ChatResult = await chat(bob, greedy(), **PATIENT)
            assert bobs.ok and not bobs.frames_of("queued"), bobs.frames[:3]
            assert not any(task.done() for task in running), "alice's calls ended before bob's: not a test"
            rest = [frame async for frame in third]
        assert rest[-1].type == "done", rest[-1]
        assert all(result.ok for result in await asyncio.gather(*running))


@pytest.fixture
def solo_mesh(tmp_path, tiny_models_dir):
    """A shard serving the whole tiny model one stream at a time, and an orchestrator."""
    with LocalCluster(work_dir=tmp_path / "cluster", torch_threads=1) as cluster:
        cluster.start_nats()
        solo = cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), 0, 5, node_id="solo",
                                   extra_args=["--max-streams", "1"], wait_ready=False)
        start_orchestrator(cluster, tiny_models_dir)
        try:
            cluster.wait_all_ready()
            yield cluster, ShardHandle(solo, "solo", 0, 5)
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(3000)}")


async def occupy(nc, cluster: LocalCluster, shard: ShardHandle, model_path: Path, pipeline_id: str) -> None:
    """Take the shard's one stream, as another orchestrator's call would."""
    digest = await asyncio.to_thread(weights_sha256, model_path)
    reply = await open_hop_as_orchestrator(nc, cluster, shard.control_subject, OpenHop(
        pipeline_id=pipeline_id, session_id="s-other", hop=0, hop_count=1, model_id=TINY_MODEL_NAME,
        weights_sha256=digest, layer_lo=shard.lo, layer_hi=shard.hi, max_session_tokens=64))
    assert reply.ok, reply


async def test_a_shard_at_capacity_makes_the_call_wait_then_try_a_replica(solo_mesh, tiny_models_dir):
    cluster, solo = solo_mesh
    model_path = tiny_models_dir / TINY_MODEL_NAME
    async with connected(cluster) as nc:
        await occupy(nc, cluster, solo, model_path, "p-other-1")
        # No replica: the call waits (keepalives) instead of failing, and runs once the stream is free.
        keepalives = 0
        frames = []
        async with contextlib.aclosing(stream_chat(nc, greedy(), include_keepalives=True, **PATIENT)) as stream:
            async for frame in stream:
                frames.append(frame)
                if frame.type == "keepalive":
                    keepalives += 1
                    if keepalives == 4:  # two seconds refused, several retries: still waiting
                        await nc.publish(solo.control_subject, CloseHop(pipeline_id="p-other-1").model_dump_json()
                                         .encode())
        assert frames[-1].type == "done", frames[-1]
        assert keepalives >= 4
        # With a replica: the full shard is routed around.
        spare = cluster.start_shard(str(model_path), 0, 5, node_id="spare")
        spare_id = spare.ready_file.read_text().strip()
        await occupy(nc, cluster, solo, model_path, "p-other-2")
        result = await chat(nc, greedy(), **PATIENT)
        assert result.ok, result.final
        assert result.frames_of("pipeline")[0].hops == [spare_id]

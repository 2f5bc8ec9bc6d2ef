"""A pipeline chain over a real nats-server: orchestrator -> hop 0 -> hop 1 -> orchestrator, sessions, stalls."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from hearth.protocol.subjects import activation_subject
from hearth.services.broker.connection import connect_nats
from hearth.services.transport import (
    AckObserver,
    AckWindowSender,
    ActivationReceiver,
    FrameKind,
    StepInfo,
    TransportTimeout,
)

pytestmark = pytest.mark.integration

PIPELINE = "pipe-chain"
HOPS = 2
wait_s = 5.0


@pytest.fixture
async def clients(nats_url):
    """One connection per process of a two-shard pipeline: the orchestrator and two shard hosts."""
    orchestrator = await connect_nats(nats_url, name="test-orchestrator")
    shards = [await connect_nats(nats_url, name=f"test-shard-{hop}") for hop in range(HOPS)]
    yield orchestrator, shards
    for client in (orchestrator, *shards):
        await client.close()


async def shard_host(nc, hop: int, forwarded: list[tuple[str, int]], *, stop_after: int | None = None) -> None:
    """A stand-in shard: adds (hop + 1) to the activation, as layers would change it, and forwards the step."""
    async with ActivationReceiver(nc, PIPELINE, hop) as inbound, AckWindowSender(nc, PIPELINE, hop + 1) as outbound:
        async for received in inbound:
            if stop_after is not None and len(forwarded) >= stop_after:
                continue  # a hung shard: it took (and acked) the step but never passes it on
            output = None if received.tensor is None else received.tensor + (hop + 1)
            await outbound.send(received.info, output)
            forwarded.append((received.session, received.step))


@contextlib.asynccontextmanager
async def running(*coroutines):
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_steps_cross_every_hop_in_order_and_acks_show_progress(clients):
    orchestrator, shards = clients
    forwarded: list[list[tuple[str, int]]] = [[], []]
    prompt = torch.randn(1, 40, 64)
    steps = [(StepInfo(session="chat-1", step=0, kind=FrameKind.prefill, pos=0), prompt)] + [
        (StepInfo(session="chat-1", step=step, kind=FrameKind.decode, pos=39 + step), torch.randn(1, 1, 64))
        for step in range(1, 8)
    ]
    async with AckObserver(orchestrator, PIPELINE, sink_hop=HOPS) as observer, ActivationReceiver(
        orchestrator, PIPELINE, HOPS
    ) as sink, AckWindowSender(orchestrator, PIPELINE, 0) as source:
        async with running(*(shard_host(shards[hop], hop, forwarded[hop]) for hop in range(HOPS))):
            await asyncio.sleep(0.1)  # let the shard hosts subscribe
            results = []
            for info, activation in steps:  # token by token, as the orchestrator pumps decode steps
                await source.send(info, activation)
                results.append(await sink.next_step(wait_s))
            await observer.wait_for_hop("chat-1", 7, HOPS, wait_s)

    assert [received.step for received in results] == list(range(8))
    for (info, activation), received in zip(steps, results):
        assert received.info == info
        assert torch.equal(received.tensor, activation + 1 + 2)
    assert forwarded == [[("chat-1", step) for step in range(8)]] * 2
    assert all(observer.holder("chat-1", step) == HOPS for step in range(8))
    assert observer.stalled(0.0) == []


async def test_a_hop_that_holds_a_step_is_named_by_the_ack_observer(clients):
    orchestrator, shards = clients
    forwarded: list[list[tuple[str, int]]] = [[], []]
    async with AckObserver(orchestrator, PIPELINE, sink_hop=HOPS) as observer, ActivationReceiver(
        orchestrator, PIPELINE, HOPS
    ) as sink, AckWindowSender(orchestrator, PIPELINE, 0) as source:
        hosts = [shard_host(shards[0], 0, forwarded[0]), shard_host(shards[1], 1, forwarded[1], stop_after=1)]
        async with running(*hosts):
            await asyncio.sleep(0.1)
            await source.send(StepInfo(session="chat-2", step=0, kind=FrameKind.prefill), torch.randn(1, 3, 8))
            await sink.next_step(wait_s)
            await source.send(StepInfo(session="chat-2", step=1, kind=FrameKind.decode, pos=3), torch.randn(1, 1, 8))
            held = await observer.wait_for_hop("chat-2", 1, 1, wait_s)
            with pytest.raises(TransportTimeout, match="held by hop 1") as raised:
                await observer.wait_for_hop("chat-2", 1, HOPS, 0.3)

    assert held.hop == 1 and held.fully_acked
    assert raised.value.hop == 1 and raised.value.step == 1
    assert observer.holder("chat-2", 0) == HOPS and observer.holder("chat-2", 1) == 1
    assert [(progress.session, progress.step, progress.hop) for progress in observer.stalled(0.1)] == [("chat-2", 1, 1)]


async def test_two_sessions_interleaved_on_one_pipeline_do_not_mix(clients):
    orchestrator, shards = clients
    hop_client = shards[0]
    second_source = shards[1]  # a second sender (e.g. another orchestrator task) on the same hop
    # Small chunks, same step numbers in both sessions: their chunks interleave on the wire.
    sessions = {"alpha": 1.0, "beta": -1.0}
    wire_order: list[str] = []

    async def watch(msg):
        wire_order.append(msg.headers["Hearth-Session"])

    watcher = await hop_client.subscribe(activation_subject(PIPELINE, 0), cb=watch)
    async with ActivationReceiver(hop_client, PIPELINE, 0) as receiver, AckWindowSender(
        orchestrator, PIPELINE, 0, chunk_bytes=256, window_chunks=3
    ) as sender_a, AckWindowSender(second_source, PIPELINE, 0, chunk_bytes=256, window_chunks=3) as sender_b:

        async def pump(sender, session: str, sign: float) -> None:
            for step in range(6):
                values = sign * (torch.arange(40 * 16, dtype=torch.float32).view(1, 40, 16) + 1000 * step)
                await sender.send(StepInfo(session=session, step=step, kind=FrameKind.prefill), values)

        pumping = asyncio.gather(pump(sender_a, "alpha", 1.0), pump(sender_b, "beta", -1.0))
        received = [await receiver.next_step(wait_s) for _ in range(12)]
        await asyncio.wait_for(pumping, wait_s)
    await watcher.unsubscribe()

    switches = sum(1 for before, after in zip(wire_order, wire_order[1:]) if before != after)
    assert len(wire_order) == 120 and switches > 11  # whole steps back to back would switch at most 11 times

    per_session = {session: [r for r in received if r.session == session] for session in sessions}
    for session, sign in sessions.items():
        assert [r.step for r in per_session[session]] == list(range(6))
        for r in per_session[session]:
            expected = sign * (torch.arange(40 * 16, dtype=torch.float32).view(1, 40, 16) + 1000 * r.step)
            assert r.header.chunk_count == 10
            assert torch.equal(r.tensor, expected)
    assert receiver.stats.dropped_steps == 0 and receiver.stats.bad_frames == 0

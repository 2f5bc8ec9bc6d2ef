"""flush_ordered against a real nats-server: a subscription sent before it is in the server's interest graph once it
returns, even when nats-py still held the SUB back behind a large publish (its own flush() can return first: its
PING overtakes the queued SUB, and a request from another connection then gets "no responders"); and a caller that
stops waiting (cancelled, or past its timeout) leaves the connection hearing, where nats-py's flush() failed its read
loop when the PONG came."""

from __future__ import annotations

import asyncio

import pytest

from hearth.services.broker.connection import flush_ordered

# Large enough that the socket takes a while to drain it: the window in which nats-py's flush() PING overtakes.
large_publish_bytes = 4 * 1024 * 1024
rounds = 20
request_timeout_s = 5.0


@pytest.mark.parametrize("flusher_busy", [False, True], ids=["queued-behind-publish", "queued-while-flusher-drains"])
async def test_a_subscription_sent_before_flush_ordered_is_known_to_the_server(connections, flusher_busy):
    requester, subscriber = connections

    async def answer(msg) -> None:
        await subscriber.publish(msg.reply, b"here")

    for round_ in range(rounds):
        await subscriber.publish("test.nobody-listens", bytes(large_publish_bytes))
        if flusher_busy:
            await asyncio.sleep(0)  # the flusher takes the publish and waits for the socket to drain it
        await subscriber.subscribe(f"test.flush.{round_}", cb=answer)
        await flush_ordered(subscriber)
        reply = await requester.request(f"test.flush.{round_}", b"?", timeout=request_timeout_s)
        assert reply.data == b"here", f"round {round_}"


async def test_flush_ordered_on_a_closed_connection_says_so(connections):
    _, subscriber = connections
    await subscriber.close()
    with pytest.raises(Exception, match="closed"):
        await flush_ordered(subscriber, 1.0)


async def test_a_cancelled_flush_ordered_leaves_the_connection_hearing(connections):
    sender, receiver = connections
    heard: asyncio.Queue = asyncio.Queue()

    async def note(msg) -> None:
        heard.put_nowait(msg.data)

    await receiver.subscribe("test.after-cancel", cb=note)
    await flush_ordered(receiver)
    for round_ in range(rounds):
        waiting = asyncio.create_task(flush_ordered(receiver, request_timeout_s))
        pings_out = len(receiver._pongs)  # read only, to cancel once its PING is out
        while len(receiver._pongs) <= pings_out:
            await asyncio.sleep(0)
        waiting.cancel()  # before its PONG is read
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await sender.publish("test.after-cancel", f"{round_}".encode())
        await sender.flush()
        assert await asyncio.wait_for(heard.get(), timeout=request_timeout_s) == f"{round_}".encode()

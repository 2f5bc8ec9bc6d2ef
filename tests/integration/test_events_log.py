"""The event log on a real nats-server: publish, read back in order, de-duplicate, skip garbage, stream specs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nats.errors
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType

from hearth.events import (
    PIPELINES_STREAM,
    SHARDS_STREAM,
    SkippedMessage,
    StoredEvent,
    decode_event,
    encode_event,
    ensure_streams,
    event_subject,
    publish_event,
    read_stream,
    stream_last_seq,
)
from hearth.events.models import EVENT_TYPES, PipelineFirstToken, ShardHeartbeat
from hearth.events.streams import STREAM_SPECS, duplicate_window_s, shards_max_msgs_per_subject, stream_for_subject
from hearth.services.common.metrics import sample_value
from hearth.services.broker.connection import connect_nats, flush_ordered
from tests.event_streams import jetstream_with_streams

pytestmark = pytest.mark.integration

EXAMPLES_PATH = Path(__file__).resolve().parents[2] / "docs" / "examples" / "events.jsonl"
UNDECODABLE_METRIC = "hearth_events_undecodable_total"


def example_records() -> list[dict]:
    return [json.loads(line) for line in EXAMPLES_PATH.read_text().splitlines() if line.strip()]


@pytest.fixture
async def js(nats_url):
    async with jetstream_with_streams(nats_url, "test-events") as jetstream:
        yield jetstream


async def read_all(js, stream: str, **kwargs) -> list[StoredEvent | SkippedMessage]:
    async with contextlib.aclosing(read_stream(js, stream, **kwargs)) as items:
        return [item async for item in items]


def heartbeat(n: int, *, shard: str = "tiny/m:0-1@node-a") -> ShardHeartbeat:
    return ShardHeartbeat(
        node_id="node-a", shard_id=shard, queue_depth=n % 3, active_streams=0, p95_latency_ms=1.5,
        tokens_served_total=n,
    )


async def consumer_counts(js) -> dict[str, int]:
    return {name: (await js.stream_info(name)).state.consumer_count for name in (SHARDS_STREAM, PIPELINES_STREAM)}


async def test_every_example_event_round_trips_through_publish_and_read_stream(js):
    records = example_records()
    assert {record["event"]["type"] for record in records} == set(EVENT_TYPES), "the contract covers every type"
    for record in records:
        event = decode_event(record["event"])
        ack = await publish_event(js, event, subject=record["subject"])
        assert ack.stream == stream_for_subject(record["subject"]) and not ack.duplicate

    read_back = await read_all(js, SHARDS_STREAM) + await read_all(js, PIPELINES_STREAM)

    assert all(isinstance(item, StoredEvent) for item in read_back)
    by_id = {item.event.event_id: item for item in read_back}
    assert len(by_id) == len(records)
    for record in records:
        item = by_id[record["event"]["event_id"]]
        assert item.subject == record["subject"]
        assert item.headers["Nats-Msg-Id"] == record["event"]["event_id"]
        assert item.event == decode_event(record["event"])
        # Nothing is lost between the JSON contract and the stored event.
        assert json.loads(encode_event(item.event)) == json.loads(encode_event(decode_event(record["event"])))
        assert item.time.tzinfo is not None
    for stream in (SHARDS_STREAM, PIPELINES_STREAM):
        seqs = [item.seq for item in read_back if item.stream == stream]
        assert seqs == list(range(1, len(seqs) + 1))


async def test_publish_uses_the_event_subject_and_the_event_id_as_msg_id(js):
    event = heartbeat(1)
    ack = await publish_event(js, event)
    (item,) = await read_all(js, SHARDS_STREAM)
    assert ack.seq == item.seq == 1
    assert item.subject == event_subject(event)
    assert item.headers["Nats-Msg-Id"] == event.event_id


async def test_a_republished_event_is_stored_once(js):
    event = heartbeat(7)
    first = await publish_event(js, event)
    second = await publish_event(js, event)
    later = await publish_event(js, heartbeat(8))
    assert not later.duplicate and later.seq == first.seq + 1

    assert not first.duplicate and second.duplicate and second.seq == first.seq
    items = await read_all(js, SHARDS_STREAM)
    assert [item.event.event_id for item in items] == [event.event_id, later_id(items)]
    assert await stream_last_seq(js, SHARDS_STREAM) == 2


def later_id(items):
    return items[-1].event.event_id


async def test_garbage_on_event_subjects_is_counted_and_skipped_while_later_events_are_read(js):
    nc = js._nc
    before = sample_value(UNDECODABLE_METRIC, {"stream": PIPELINES_STREAM})
    good_first = PipelineFirstToken(node_id="hub", pipeline_id="p-1", ttft_ms=10.0)
    await publish_event(js, good_first)
    await js.publish("hearth.events.pipeline.p-1.first_token", b"{not json")
    await js.publish("hearth.events.pipeline.p-1.exploded", json.dumps(
        {"event_id": "x1", "type": "pipeline.exploded", "version": 1, "node_id": "hub", "pipeline_id": "p-1"}
    ).encode())
    missing_field = json.loads(encode_event(PipelineFirstToken(node_id="hub", pipeline_id="p-1", ttft_ms=1.0)))
    del missing_field["ttft_ms"]
    await js.publish("hearth.events.pipeline.p-1.first_token", json.dumps(missing_field).encode())
    await js.publish("hearth.events.pipeline.p-1.first_token", b"[1, 2, 3]")
    good_last = PipelineFirstToken(node_id="hub", pipeline_id="p-2", ttft_ms=20.0)
    await publish_event(js, good_last)
    await flush_ordered(nc)

    items = await read_all(js, PIPELINES_STREAM)

    assert [type(item).__name__ for item in items] == [
        "StoredEvent", "SkippedMessage", "SkippedMessage", "SkippedMessage", "SkippedMessage", "StoredEvent",
    ]
    assert items[0].event == good_first and items[-1].event == good_last
    skipped = [item for item in items if isinstance(item, SkippedMessage)]
    assert [item.seq for item in skipped] == [2, 3, 4, 5]
    assert "JSONDecodeError" in skipped[0].error
    assert "pipeline.exploded" in skipped[1].error
    assert "ttft_ms" in skipped[2].error
    assert "JSON object" in skipped[3].error
    assert sample_value(UNDECODABLE_METRIC, {"stream": PIPELINES_STREAM}) == before + 4


async def test_ensure_streams_is_idempotent_and_safe_when_processes_race(js):
    await ensure_streams(js)
    await asyncio.gather(*(ensure_streams(js) for _ in range(4)))
    await publish_event(js, heartbeat(1))
    await ensure_streams(js)
    # Data survives and the specs are as designed.
    assert await stream_last_seq(js, SHARDS_STREAM) == 1
    shards = (await js.stream_info(SHARDS_STREAM)).config
    pipelines = (await js.stream_info(PIPELINES_STREAM)).config
    assert shards.subjects == ["hearth.events.shard.>"]
    assert set(pipelines.subjects) == {"hearth.events.pipeline.>", "hearth.events.integrity.>"}
    for config in (shards, pipelines):
        assert config.storage == StorageType.FILE
        assert config.retention == RetentionPolicy.LIMITS
        assert config.discard == DiscardPolicy.OLD
        assert config.duplicate_window == pytest.approx(duplicate_window_s)
    assert shards.max_age == pytest.approx(7 * 24 * 3600)
    assert pipelines.max_age == pytest.approx(30 * 24 * 3600)
    assert shards.max_msgs_per_subject == shards_max_msgs_per_subject
    assert pipelines.max_msgs_per_subject == -1


async def test_ensure_streams_brings_a_drifted_stream_back_to_the_spec(js):
    drifted = STREAM_SPECS[0].config()
    drifted.max_age = 3600.0
    drifted.max_msgs_per_subject = 5
    await js.update_stream(drifted)
    await publish_event(js, heartbeat(1))

    await ensure_streams(js)

    config = (await js.stream_info(SHARDS_STREAM)).config
    assert config.max_age == pytest.approx(7 * 24 * 3600)
    assert config.max_msgs_per_subject == shards_max_msgs_per_subject
    assert await stream_last_seq(js, SHARDS_STREAM) == 1


async def test_bounded_reads_honour_sequences_filters_and_stop_at_the_end_as_of_the_start(js):
    for n in range(1, 7):
        await publish_event(js, heartbeat(n, shard="tiny/m:0-1@a" if n % 2 else "tiny/m:2-3@b"))

    assert [i.seq for i in await read_all(js, SHARDS_STREAM, from_seq=3)] == [3, 4, 5, 6]
    assert [i.seq for i in await read_all(js, SHARDS_STREAM, from_seq=2, to_seq=4)] == [2, 3, 4]
    assert await read_all(js, SHARDS_STREAM, from_seq=7) == []
    odd_subject = event_subject(heartbeat(1, shard="tiny/m:0-1@a"))
    assert [i.seq for i in await read_all(js, SHARDS_STREAM, subject_filter=odd_subject)] == [1, 3, 5]
    # A filter that matches nothing ends at once instead of waiting.
    assert await read_all(js, SHARDS_STREAM, subject_filter="hearth.events.shard.nothing.>") == []
    # Several filters at once.
    both = [odd_subject, "hearth.events.shard.*.*.withdrawn"]
    assert [i.seq for i in await read_all(js, SHARDS_STREAM, subject_filter=both)] == [1, 3, 5]
    # An empty stream is read as empty.
    assert await read_all(js, PIPELINES_STREAM) == []

    # Messages published while a bounded read runs are not part of it.
    seen = []
    async with contextlib.aclosing(read_stream(js, SHARDS_STREAM)) as items:
        async for item in items:
            if item.seq == 1:
                await publish_event(js, heartbeat(100))
            seen.append(item.seq)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert await stream_last_seq(js, SHARDS_STREAM) == 7


async def test_from_time_starts_at_the_first_message_stored_at_or_after_it(js):
    await publish_event(js, heartbeat(1))
    await asyncio.sleep(0.05)
    cut = datetime.now(timezone.utc)
    await asyncio.sleep(0.05)
    await publish_event(js, heartbeat(2))
    await publish_event(js, heartbeat(3))

    items = await read_all(js, SHARDS_STREAM, from_time=cut)
    assert [item.seq for item in items] == [2, 3]
    assert await read_all(js, SHARDS_STREAM, from_time=cut + timedelta(hours=1)) == []


async def test_follow_delivers_new_events_and_no_consumer_is_left_behind(js):
    await publish_event(js, heartbeat(1))
    received: list[int] = []

    async def follow() -> None:
        async with contextlib.aclosing(read_stream(js, SHARDS_STREAM, follow=True)) as items:
            async for item in items:
                received.append(item.event.tokens_served_total)
                if len(received) == 3:
                    return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    assert (await consumer_counts(js))[SHARDS_STREAM] == 1
    await publish_event(js, heartbeat(2))
    await publish_event(js, heartbeat(3))
    await asyncio.wait_for(task, timeout=10)

    assert received == [1, 2, 3]
    assert await consumer_counts(js) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


async def test_follow_with_to_seq_stops_there(js):
    async def publish_later() -> None:
        for n in range(1, 5):
            await publish_event(js, heartbeat(n))

    publisher = asyncio.create_task(publish_later())
    items = await asyncio.wait_for(read_all(js, SHARDS_STREAM, follow=True, to_seq=3), timeout=10)
    await publisher
    assert [item.seq for item in items] == [1, 2, 3]


async def test_a_large_log_is_read_in_order_with_nothing_lost(js):
    # ~8 MB in 1000 messages: the push consumer pauses for flow-control replies several times on the way. The
    # bulk rides in a header: event fields have maximum lengths.
    padding = "x" * 8000
    events = [heartbeat(n, shard=f"tiny/m:0-1@n{n % 7}") for n in range(1000)]
    acks = await asyncio.gather(*[
        await js.publish_async(event_subject(e), encode_event(e),
                               headers={"Nats-Msg-Id": e.event_id, "Test-Padding": padding})
        for e in events
    ])
    assert len({ack.seq for ack in acks}) == len(events)

    items = await read_all(js, SHARDS_STREAM, idle_timeout_s=5.0)

    assert [item.seq for item in items] == list(range(1, len(events) + 1))
    assert [item.event.tokens_served_total for item in items] == list(range(1000))


async def test_following_survives_a_server_restart(nats_server):
    nc = await connect_nats(nats_server.url, name="test-restart")
    js = nc.jetstream()
    await ensure_streams(js)
    received: list[int] = []
    done = asyncio.Event()

    async def follow() -> None:
        async with contextlib.aclosing(read_stream(js, SHARDS_STREAM, follow=True)) as items:
            async for item in items:
                received.append(item.event.tokens_served_total)
                if len(received) == 4:
                    done.set()
                    return

    task = asyncio.create_task(follow())
    try:
        await publish_event(js, heartbeat(1))
        await publish_event(js, heartbeat(2))
        await asyncio.wait_for(_until(lambda: len(received) == 2), timeout=10)

        await asyncio.to_thread(nats_server.restart)
        await publish_event(js, heartbeat(3))
        await publish_event(js, heartbeat(4))
        await asyncio.wait_for(done.wait(), timeout=20)
        await task
        assert received == [1, 2, 3, 4]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nc.close()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.02)


async def test_publish_rides_out_a_broker_restart_and_stores_the_event_once(nats_server):
    nc = await connect_nats(nats_server.url, name="test-publish-retry")
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        await publish_event(js, heartbeat(1))
        await asyncio.to_thread(nats_server.stop)
        event = heartbeat(2)
        publishing = asyncio.create_task(publish_event(js, event, timeout_s=1.0, max_attempts=10))
        await asyncio.sleep(0.5)
        assert not publishing.done()
        await asyncio.to_thread(nats_server.start)

        ack = await asyncio.wait_for(publishing, timeout=30)

        assert ack.seq == 2
        items = await read_all(js, SHARDS_STREAM)
        assert [item.event.event_id for item in items][-1] == event.event_id and len(items) == 2
    finally:
        await nc.close()


async def test_a_read_on_a_connection_closed_for_good_ends_instead_of_retrying_forever(nats_url):
    nc = await connect_nats(nats_url, name="test-closed-read")
    js = nc.jetstream()
    await ensure_streams(js)
    await nc.close()

    with pytest.raises(nats.errors.ConnectionClosedError):
        await asyncio.wait_for(read_all(js, SHARDS_STREAM, follow=True), timeout=10)

"""What a reader may make of its right to create consumers, on a real community broker: the streams' limits refuse a
consumer that would outlive its member, and the steward's sweep (hearth/services/broker/consumer_sweep.py) deletes
one that pushes a stream anywhere but a reader's inbox, while hearth's own readers are left alone."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from hearth.events import PIPELINES_STREAM, SHARDS_STREAM, ensure_streams, publish_event
from hearth.events.consume import read_stream
from hearth.events.models import ShardHeartbeat
from hearth.events.streams import consumer_inactive_limit_s
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.broker.consumer_sweep import (
    ConsumerSweeper,
    listed_consumers,
    max_consumers_per_member,
    sweep_consumers,
)
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.common.config import NatsSettings
from hearth.trust.community import Community

pytestmark = pytest.mark.integration
SWEEP_WAIT_S = 15.0


@pytest.fixture
def community_server(tmp_path):
    community = Community.init(tmp_path / "community", "sweep-test")
    community.add("eve", "auditor")
    community.add("orch", "orchestrator")
    with EmbeddedNatsServer(store_dir=tmp_path / "nats",
                            authorization=render_authorization(community.roster())) as server:
        yield community, server


async def connect_as(community: Community, server: EmbeddedNatsServer, name: str):
    settings = NatsSettings(url=server.url, creds_file=community.directory / "keys" / f"{name}.nk",
                            connect_timeout_s=5)
    return await connect_nats(settings=settings, name=f"test-{name}")


def heartbeat(tokens_served: int) -> ShardHeartbeat:
    return ShardHeartbeat(node_id="orch", shard_id="m:0-1@orch", queue_depth=0, active_streams=0,
                          p95_latency_ms=1.0, tokens_served_total=tokens_served)


async def create_named_consumer(nc, stream: str, config: dict) -> dict:
    """The API request a reader is granted (CONSUMER.CREATE.<stream>.<name>), with any body it likes."""
    body = {"stream_name": stream, "config": {"ack_policy": "explicit", **config}}
    name = config.get("durable_name") or config["name"]
    reply = await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
                             json.dumps(body).encode(), timeout=5)
    return json.loads(reply.data)


async def consumer_names(nc, stream: str) -> set[str]:
    """As the broker lists them (nats-py's models fail on settings a member may choose)."""
    return {entry["name"] for entry in await listed_consumers(nc, stream)}


async def test_a_reader_pushing_a_stream_onto_another_subject_is_swept_and_its_own_readers_stay(community_server):
    community, server = community_server
    steward = await connect_as(community, server, "system")
    eve = await connect_as(community, server, "eve")
    orch = await connect_as(community, server, "orch")
    try:
        # A consumer of the steward's, made before the streams had limits, would outlive whoever made it.
        await steward.jetstream().add_stream(StreamConfig(name=SHARDS_STREAM, subjects=["hearth.events.shard.>"]))
        await steward.jetstream().add_consumer(SHARDS_STREAM, ConsumerConfig(durable_name="old-durable",
                                                                              ack_policy=AckPolicy.EXPLICIT))
        await ensure_streams(steward.jetstream(), replicas=1)
        await publish_event(steward.jetstream(), heartbeat(1))
        requests: list[bytes] = []
        pushed = asyncio.Event()

        async def on_request(msg) -> None:
            requests.append(msg.data)
            pushed.set()

        await orch.subscribe(CHAT_REQUEST_SUBJECT, cb=on_request)
        await flush_ordered(orch)
        js = eve.jetstream()
        # The broker lets eve create consumers on the streams she reads, whatever they ask for ...
        await js.add_consumer(SHARDS_STREAM, ConsumerConfig(name="pushes-elsewhere", ack_policy=AckPolicy.NONE,
                                                            deliver_subject=CHAT_REQUEST_SUBJECT))
        await asyncio.wait_for(pushed.wait(), 5)  # ... so the orchestrators' request subject hears the stream
        own_inbox = eve.new_inbox()
        await eve.subscribe(own_inbox)
        await js.add_consumer(SHARDS_STREAM, ConsumerConfig(name="own-inbox", ack_policy=AckPolicy.NONE,
                                                            deliver_subject=own_inbox))
        # A durable, through the subject she may use: the stream's limits hold it to the inactivity limit, and as a
        # pull consumer (hearth's readers never make one) it is swept.
        refused = await create_named_consumer(eve, PIPELINES_STREAM, {"durable_name": "forever",
                                                                      "inactive_threshold": 3600 * 10**9})
        assert "inactive threshold exceeds" in refused["error"]["description"]
        limited = await create_named_consumer(eve, PIPELINES_STREAM, {"durable_name": "limited"})
        assert limited["config"]["inactive_threshold"] == consumer_inactive_limit_s * 10**9

        swept = await sweep_consumers(steward, community.roster())
        assert sorted((entry.stream, entry.name) for entry in swept) == [
            (PIPELINES_STREAM, "limited"), (SHARDS_STREAM, "old-durable"), (SHARDS_STREAM, "pushes-elsewhere")]
        assert await consumer_names(steward, SHARDS_STREAM) == {"own-inbox"}
        assert await consumer_names(steward, PIPELINES_STREAM) == set()
        # hearth's own reader, as the orchestrator, following the stream: untouched by a sweep while it reads.
        async with aclosing(read_stream(orch.jetstream(), SHARDS_STREAM, follow=True)) as reading:
            assert (await anext(reading)).event.shard_id == "m:0-1@orch"
            assert len(await consumer_names(steward, SHARDS_STREAM)) == 2
            assert await sweep_consumers(steward, community.roster()) == []
            await publish_event(steward.jetstream(), heartbeat(2))
            assert (await asyncio.wait_for(anext(reading), 5)).event.tokens_served_total == 2
    finally:
        for connection in (steward, eve, orch):
            await connection.close()


async def test_the_sweeper_thread_sweeps_again_and_again_and_stops(community_server):
    community, server = community_server
    steward = await connect_as(community, server, "system")
    eve = await connect_as(community, server, "eve")
    reported = []
    sweeper = ConsumerSweeper(NatsSettings(url=server.url), community.system_key_path, community.roster_path,
                              report=reported.append, interval_s=0.2).start()
    try:
        await ensure_streams(steward.jetstream(), replicas=1)
        for round_ in range(2):
            name = f"pushes-elsewhere-{round_}"
            await eve.jetstream().add_consumer(PIPELINES_STREAM, ConsumerConfig(
                name=name, ack_policy=AckPolicy.NONE, deliver_subject="hearth.act.somewhere"))
            deadline = asyncio.get_running_loop().time() + SWEEP_WAIT_S
            # Reported once the sweep that deleted it has ended: a moment after it is gone.
            while (name in await consumer_names(steward, PIPELINES_STREAM)
                   or name not in [entry.name for entry in reported]):
                assert asyncio.get_running_loop().time() < deadline, f"{name} was never swept and reported"
                await asyncio.sleep(0.1)
        assert [entry.name for entry in reported] == ["pushes-elsewhere-0", "pushes-elsewhere-1"]
    finally:
        await asyncio.to_thread(sweeper.stop)
        for connection in (steward, eve):
            await connection.close()
    assert not sweeper._thread.is_alive()


async def test_settings_a_client_cannot_parse_and_one_member_taking_every_place_are_swept(community_server):
    community, server = community_server
    steward = await connect_as(community, server, "system")
    eve = await connect_as(community, server, "eve")
    try:
        await ensure_streams(steward.jetstream(), replicas=1)
        inbox = eve.new_inbox()
        await eve.subscribe(f"{inbox}.>")
        # A start time nats-py's models fail to parse (a fraction with a negative offset), pushed to her own inbox:
        # it may stay, and the sweep still judges every other consumer.
        poison = await create_named_consumer(eve, SHARDS_STREAM, {
            "name": "odd-time", "deliver_subject": f"{inbox}.odd", "ack_policy": "none",
            "deliver_policy": "by_start_time", "opt_start_time": "2020-01-01T00:00:00.5-05:00"})
        assert "error" not in poison, poison
        for index in range(max_consumers_per_member + 3):
            await create_named_consumer(eve, SHARDS_STREAM, {"name": f"own-{index}", "ack_policy": "none",
                                                            "deliver_subject": f"{inbox}.{index}"})
        await create_named_consumer(eve, SHARDS_STREAM, {"name": "pull", "ack_policy": "explicit"})
        swept = await sweep_consumers(steward, community.roster())
        assert {entry.name for entry in swept} == {"pull", *(f"own-{index}" for index in range(
            max_consumers_per_member - 1, max_consumers_per_member + 3))}
        left = await consumer_names(steward, SHARDS_STREAM)
        assert "odd-time" in left and len(left) == max_consumers_per_member
    finally:
        for connection in (steward, eve):
            await connection.close()


async def test_a_consumer_pushing_into_another_readers_inbox_is_swept_as_soon_as_the_broker_audits_it(
        community_server):
    """The broker's audit names who created a consumer: eve's consumers pushing into the orchestrator's inbox go at
    once, so they can neither be heard there nor use up the orchestrator's places on the stream, while the
    orchestrator's own reader and eve's consumer into her own inbox stay."""
    community, server = community_server
    steward = await connect_as(community, server, "system")
    eve = await connect_as(community, server, "eve")
    orch = await connect_as(community, server, "orch")
    reported = []
    # Only the audit sets a sweep off within the test's wait; the periodic one would come too late.
    sweeper = ConsumerSweeper(NatsSettings(url=server.url), community.system_key_path, community.roster_path,
                              report=reported.append, interval_s=600).start()
    try:
        await ensure_streams(steward.jetstream(), replicas=1)
        await publish_event(steward.jetstream(), heartbeat(1))
        deadline = asyncio.get_running_loop().time() + SWEEP_WAIT_S
        while not sweeper.creators and asyncio.get_running_loop().time() < deadline:
            # Until the sweeper hears the audit: each of these is eve's own and stays.
            await create_named_consumer(eve, SHARDS_STREAM, {
                "name": f"own-{len(await consumer_names(steward, SHARDS_STREAM))}", "ack_policy": "none",
                "deliver_subject": f"{eve.new_inbox()}.own", "inactive_threshold": 10**9})
            await asyncio.sleep(0.1)
        squatters = [f"squat-{index}" for index in range(3)]
        for name in squatters:
            created = await create_named_consumer(eve, SHARDS_STREAM, {
                "name": name, "ack_policy": "none", "deliver_subject": f"{orch.new_inbox()}.stolen"})
            assert "error" not in created, created
        while {entry.name for entry in reported} != set(squatters):
            assert asyncio.get_running_loop().time() < deadline, f"swept only {reported}"
            await asyncio.sleep(0.1)
        assert all("eve made it deliver" in entry.why for entry in reported)
        left = await consumer_names(steward, SHARDS_STREAM)
        assert left and all(name.startswith("own-") for name in left)
        async with aclosing(read_stream(orch.jetstream(), SHARDS_STREAM, follow=True)) as reading:
            assert (await anext(reading)).event.tokens_served_total == 1
            await publish_event(steward.jetstream(), heartbeat(2))
            assert (await asyncio.wait_for(anext(reading), 5)).event.tokens_served_total == 2
        assert {entry.name for entry in reported} == set(squatters)
    finally:
        await asyncio.to_thread(sweeper.stop)
        for connection in (steward, eve, orch):
            await connection.close()

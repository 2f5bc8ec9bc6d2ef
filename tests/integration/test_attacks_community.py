"""Attacks on a community mesh's broker by one hostile member, on a real nats-server configured from the roster: what
each role's permissions must refuse beyond tests/integration/test_community_permissions.py and
tests/e2e/test_attacks_broker.py (reflecting a publish off the broker's response permissions), and the answers the
roles must still get."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest

from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.server import EmbeddedNatsServer, default_max_subscriptions_per_connection
from hearth.services.broker.streams import create_community_streams
from hearth.services.common.config import NatsSettings
from hearth.trust.community import Community
from tests.integration.test_community_permissions import Member

pytestmark = pytest.mark.integration
# Long enough for the broker to deliver what it let through to a subscriber on the same machine.
DELIVERY_WAIT_S = 1.0
# Where a reflected publish would do harm (the event log, another member's inbox, JetStream's administration), by the
# subject the host bounces it off.
REFLECTION_TARGETS = {
    "hearth.ctl.shard-a.abc": ("hearth.events.pipeline.p1.completed", "_INBOX.alice.stolen",
                               f"$JS.API.STREAM.DELETE.{SHARDS_STREAM}"),
    "hearth.act.shard-a.p1.0": ("hearth.events.integrity.p1.mismatch", "_INBOX.alice.stolen-2",
                                f"$JS.API.STREAM.PURGE.{PIPELINES_STREAM}")}


@pytest.fixture
async def mesh(tmp_path):
    community = Community.init(tmp_path / "community", "test-community")
    for name, role in (("shard-a", "shard"), ("orch", "orchestrator"), ("alice", "client"), ("eve", "auditor")):
        community.add(name, role)
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", authorization=render_authorization(community.roster())) \
            as server:
        await create_community_streams(NatsSettings(url=server.url), community.system_key_path, ready_timeout_s=10)
        steward = await connect_nats(settings=NatsSettings(url=server.url, creds_file=community.system_key_path),
                                     name="steward-watcher")
        try:
            yield community, server, steward
        finally:
            await steward.close()


async def test_a_shard_host_cannot_reflect_a_publish_off_its_own_subjects(mesh):
    """A host publishes on a subject it also hears (its own control or activation subject) naming a reply it may
    not publish to; once the message comes back to it, a response permission would let it publish there."""
    community, server, steward = mesh
    seen: list[str] = []

    async def record(msg) -> None:
        seen.append(msg.subject)

    targets = [target for targets in REFLECTION_TARGETS.values() for target in targets]
    for target in targets:
        await steward.subscribe(target, cb=record)
    await flush_ordered(steward, DELIVERY_WAIT_S)
    shard = await Member(community, "shard-a").connect(server.url)
    heard: list[str] = []

    async def hear(msg) -> None:
        heard.append(msg.reply)

    try:
        for own in ("hearth.ctl.shard-a.>", "hearth.act.shard-a.>"):
            await shard.nc.subscribe(own, cb=hear)
        await flush_ordered(shard.nc, DELIVERY_WAIT_S)
        for own, replies in REFLECTION_TARGETS.items():
            for reply in replies:
                await shard.nc.publish(own, b"{}", reply=reply)
        await flush_ordered(shard.nc, DELIVERY_WAIT_S)
        assert sorted(heard) == sorted(targets)  # the attack's first half works: it hears them
        for reply in targets:
            assert await shard.refused(lambda nc: nc.publish(reply, b"")), reply
        await asyncio.sleep(DELIVERY_WAIT_S)
        assert seen == [], f"the broker let the reflected publishes through to {seen}"
    finally:
        await shard.nc.close()
    for stream in ALL_STREAMS:
        await steward.jetstream().stream_info(stream)  # raises NotFoundError were it deleted


async def test_a_shard_host_still_answers_an_orchestrator_and_its_own_node(mesh):
    community, server, _ = mesh
    host = await Member(community, "shard-a").connect(server.url)

    async def answer(msg) -> None:
        await msg.respond(b"ok")

    await host.nc.subscribe("hearth.ctl.shard-a.abc", cb=answer)
    await flush_ordered(host.nc, DELIVERY_WAIT_S)
    askers = [await Member(community, name).connect(server.url) for name in ("orch", "shard-a")]
    try:
        # Also after a reload (each roster change): nats-server forgets response permissions there.
        for reload in (False, True):
            if reload:
                await asyncio.to_thread(server.reload, render_authorization(community.roster()))
            for asker in askers:
                assert (await asker.nc.request("hearth.ctl.shard-a.abc", b"{}", timeout=5)).data == b"ok"
                assert asker.errors == [] and host.errors == []
    except nats.errors.TimeoutError:
        pytest.fail("the host's answer was refused by the broker")
    finally:
        for member in (*askers, host):
            await member.nc.close()


async def _connect_once_freed(community: Community, url: str, within_s: float = 10.0):
    """alice connected, once the broker has seen a closed connection go: it counts it freed a moment after the client
    closed it, and refuses a connection made in between as over its limit."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        try:
            return await Member(community, "alice").connect(url)
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_one_member_cannot_open_more_connections_than_the_broker_admits(tmp_path):
    """nats-server's own default admits 64K connections, each a file descriptor and buffers: a member could open them
    until the broker's machine runs out. The broker admits `max_connections` (here a small one), whoever asks."""
    community = Community.init(tmp_path / "community", "test-community")
    community.add("alice", "client")
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", authorization=render_authorization(community.roster()),
                            max_connections=4) as server:
        held = [await Member(community, "alice").connect(server.url) for _ in range(4)]
        try:
            with pytest.raises(Exception):  # nats-server: "maximum connections exceeded", then it closes the socket
                await Member(community, "alice").connect(server.url)
            await held.pop().nc.close()
            held.append(await _connect_once_freed(community, server.url))  # a place freed is a place again
        finally:
            for member in held:
                await member.nc.close()


async def test_a_connection_cannot_hold_more_subscriptions_than_the_default_limit(mesh):
    """Each subscription costs the broker memory, and nats-server's own default is no limit: one connection may hold
    `default_max_subscriptions_per_connection`, far above what an orchestrator with many calls needs; the next is
    refused (nats-py then closes the connection) while the other members are served as before."""
    community, server, _ = mesh
    hostile, other = [await Member(community, name).connect(server.url) for name in ("orch", "shard-a")]
    try:
        for index in range(default_max_subscriptions_per_connection - 1):
            await hostile.nc.subscribe(f"hearth.act.shard-a.p{index}.0")
        await flush_ordered(hostile.nc, DELIVERY_WAIT_S)
        assert hostile.errors == []
        assert await hostile.refused(lambda nc: nc.subscribe("hearth.act.shard-a.one-too-many.0")) is False
        await hostile.nc.subscribe("hearth.act.shard-a.over.0")
        with contextlib.suppress(nats.errors.Error):  # nats-py closes a connection the server says this to
            await flush_ordered(hostile.nc, DELIVERY_WAIT_S)
        assert "maximum subscriptions exceeded" in str(hostile.nc.last_error).lower(), hostile.nc.last_error
        heard = await other.nc.subscribe("hearth.ctl.shard-a.abc")
        await other.nc.publish("hearth.ctl.shard-a.abc", b"still served")
        assert (await heard.next_msg(timeout=5)).data == b"still served"
    finally:
        for member in (hostile, other):
            await member.nc.close()


async def test_a_reader_reflects_jetstream_answers_only_into_the_log_as_unsigned_messages(mesh):
    """The open threat of docs/design.md §11: JetStream answers on any reply subject. An auditor's STREAM.INFO,
    answered onto another node's shard subject, is stored there (no event: projectors skip it); answered onto
    JetStream's administration, it administers nothing. A client has no JetStream grant to start from."""
    community, server, steward = mesh
    js = steward.jetstream()
    victim_subject = "hearth.events.shard.shard-a.0000.advertised"
    auditor, client = [await Member(community, name).connect(server.url) for name in ("eve", "alice")]
    try:
        for reply in (victim_subject, f"$JS.API.STREAM.DELETE.{SHARDS_STREAM}"):
            assert not await auditor.refused(
                lambda nc, reply=reply: nc.publish(f"$JS.API.STREAM.INFO.{PIPELINES_STREAM}", b"", reply=reply))
        assert await client.refused(
            lambda nc: nc.publish(f"$JS.API.STREAM.INFO.{PIPELINES_STREAM}", b"", reply=victim_subject))
        stored = await js.get_last_msg(SHARDS_STREAM, victim_subject)  # the stream itself is still there
        assert stored.data.startswith(b'{"type":"io.nats.jetstream.api.v1.stream_info_response"')
        assert not stored.headers  # neither an event nor signed: every projector skips it as undecodable
    finally:
        for member in (auditor, client):
            await member.nc.close()

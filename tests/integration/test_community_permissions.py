"""The broker enforces the community's roles: a real nats-server configured by `render_authorization` refuses
a connection without credentials (or with a key `hearth community rotate-key` retired) and refuses each member what
its role may not do."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import NoServersError

from hearth.events.streams import ALL_STREAMS, StreamSetup
from hearth.protocol.subjects import orchestrator_request_subject, shard_events_subject_of_node
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.community_rotation import rotate_member_key
from hearth.services.broker.connection import BrokerRefusedCredentials, connect_nats, flush_ordered
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.streams import create_community_streams
from hearth.services.common.call_nonces import CALL_NONCES_BUCKET, CALL_NONCES_STREAM, MeshNonces
from hearth.services.broker.server import EmbeddedNatsServer, NatsServerError, server_start_timeout_s
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey

pytestmark = pytest.mark.integration
VIOLATION_WAIT_S = 2.0

# Members added (each a broker reload) while another connects again and again: before the refusal grace, about 1
# in 130 such connects was refused.
reloads_while_connecting = 20


@pytest.fixture
def community_server(tmp_path):
    community = Community.init(tmp_path / "community", "test-community")
    for name, role in (("shard-a", "shard"), ("shard-b", "shard"), ("orch", "orchestrator"), ("alice", "client"),
                       ("eve", "auditor")):
        community.add(name, role)
    community.add("untrusted-host", "shard", trust="member")
    authorization = render_authorization(community.roster())
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", authorization=authorization) as server:
        yield community, server


class Member:
    """A raw nats-py connection as one member, collecting the permission errors the server sends."""

    def __init__(self, community: Community, name: str) -> None:
        self.community, self.name = community, name
        self.errors: list[str] = []
        self.violation = asyncio.Event()

    async def connect(self, url: str):
        async def on_error(error: Exception) -> None:
            self.errors.append(str(error))
            if "permissions violation" in str(error).lower():
                self.violation.set()

        seed = (self.community.directory / "keys" / f"{self.name}.nk").read_text()
        self.nc = await nats.connect(url, nkeys_seed_str=seed, inbox_prefix=f"_INBOX.{self.name}",
                                     error_cb=on_error, allow_reconnect=False, connect_timeout=2)
        return self

    async def refused(self, action) -> bool:
        """Whether the server answers `action` (a subscribe or publish) with a permissions violation."""
        self.violation.clear()
        await action(self.nc)
        # The server answers a command it refuses with -ERR before it answers the PING that follows it, and nats-py
        # runs the error callback before it reads further: once the PONG is in, a refusal would have been heard.
        await flush_ordered(self.nc, VIOLATION_WAIT_S)
        return self.violation.is_set()


async def test_no_credentials_no_connection(community_server):
    _, server = community_server
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)


async def test_a_member_below_trusted_cannot_serve_shards(community_server):
    community, server = community_server
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await Member(community, "untrusted-host").connect(server.url)


async def test_each_role_gets_only_its_own_subjects(community_server):
    community, server = community_server
    shard = await Member(community, "shard-a").connect(server.url)
    client = await Member(community, "alice").connect(server.url)
    auditor = await Member(community, "eve").connect(server.url)
    try:
        # Nobody in the roster may read everything.
        for member in (shard, client, auditor):
            assert await member.refused(lambda nc: nc.subscribe(">")), member.name
        # A shard host: its own control subject yes, another's no; its own events yes, another's no.
        assert not await shard.refused(lambda nc: nc.subscribe("hearth.ctl.shard-a.abc"))
        assert await shard.refused(lambda nc: nc.subscribe("hearth.ctl.shard-b.abc"))
        # It may ask its own node's shards (a restarted `hearth host`: which of them still serve), not another's.
        assert not await shard.refused(lambda nc: nc.publish("hearth.ctl.shard-a.abc", b"{}"))
        assert await shard.refused(lambda nc: nc.publish("hearth.ctl.shard-b.abc", b"{}"))
        assert await shard.refused(lambda nc: nc.subscribe("hearth.act.shard-b.p1.0"))
        assert not await shard.refused(lambda nc: nc.publish(
            shard_events_subject_of_node("shard-a").replace(">", "k.heartbeat"), b"{}"))
        assert await shard.refused(lambda nc: nc.publish(
            shard_events_subject_of_node("shard-b").replace(">", "k.advertised"), b"{}"))
        assert await shard.refused(lambda nc: nc.publish("hearth.events.pipeline.p1.completed", b"{}"))
        # It may read the shards stream (`hearth host` reads the coverage) but not the pipelines stream.
        assert not await shard.refused(lambda nc: nc.publish("$JS.API.STREAM.INFO.HEARTH_SHARDS", b""))
        assert await shard.refused(lambda nc: nc.publish("$JS.API.STREAM.INFO.HEARTH_PIPELINES", b""))
        # Administering a stream is the steward's alone, even the one it reads.
        assert await shard.refused(lambda nc: nc.publish("$JS.API.STREAM.UPDATE.HEARTH_SHARDS", b"{}"))
        assert await auditor.refused(lambda nc: nc.publish("$JS.API.STREAM.PURGE.HEARTH_PIPELINES", b"{}"))
        assert await shard.refused(lambda nc: nc.publish("$JS.API.CONSUMER.CREATE.HEARTH_PIPELINES", b"{}"))
        # A client: asks, and hears only on its own inbox.
        assert not await client.refused(lambda nc: nc.publish("llm.chat.request", b"{}"))
        assert await client.refused(lambda nc: nc.subscribe("llm.chat.request"))
        # Any orchestrator's own subject (a conversation's next turn), to send only.
        assert not await client.refused(lambda nc: nc.publish(orchestrator_request_subject("orch"), b"{}"))
        assert await client.refused(lambda nc: nc.subscribe(orchestrator_request_subject("orch")))
        assert await client.refused(lambda nc: nc.subscribe("_INBOX.shard-a.x"))
        assert await client.refused(lambda nc: nc.publish("hearth.ctl.shard-a.abc", b"{}"))
        # An auditor reads the streams' API, but publishes nothing into the log.
        assert await auditor.refused(lambda nc: nc.publish("hearth.events.pipeline.p1.completed", b"{}"))
        # An orchestrator hears the queue's subject and its own, not another orchestrator's.
        orchestrator = await Member(community, "orch").connect(server.url)
        try:
            assert not await orchestrator.refused(lambda nc: nc.subscribe("llm.chat.request", queue="q"))
            assert not await orchestrator.refused(lambda nc: nc.subscribe(orchestrator_request_subject("orch")))
            assert await orchestrator.refused(lambda nc: nc.subscribe(orchestrator_request_subject("orch-b")))
        finally:
            await orchestrator.nc.close()
    finally:
        for member in (shard, client, auditor):
            await member.nc.close()


async def test_only_orchestrators_record_call_nonces_and_nobody_reads_or_clears_them(community_server):
    community, server = community_server
    await create_community_streams(NatsSettings(url=server.url), community.system_key_path, ready_timeout_s=10)
    settings = NatsSettings(url=server.url, creds_file=community.directory / "keys" / "orch.nk", connect_timeout_s=5)
    nc = await connect_nats(settings=settings, name="test-orch")
    try:  # through its own inbox and the steward's bucket, as a running orchestrator records one
        nonces = MeshNonces(nc.jetstream(), window_s=60, recorded_by="orch")
        await nonces.ready(StreamSetup(create=False, wait_s=5))
        signer = MemberKey.load(community.directory / "keys" / "alice.nk").public_key
        assert await nonces.first_on_mesh(signer, "ab" * 16)
        assert not await nonces.first_on_mesh(signer, "ab" * 16)
    finally:
        await nc.close()
    record = f"$KV.{CALL_NONCES_BUCKET}.{signer}.{'cd' * 16}"
    members = [await Member(community, name).connect(server.url) for name in ("alice", "shard-a", "eve", "orch")]
    client, shard, auditor, orchestrator = members
    try:
        for member in (client, shard, auditor):
            assert await member.refused(lambda nc: nc.publish(record, b"x")), member.name
            assert await member.refused(lambda nc: nc.publish(f"$JS.API.STREAM.INFO.{CALL_NONCES_STREAM}", b"")), \
                member.name
        assert not await orchestrator.refused(lambda nc: nc.publish(record, b"orch"))
        for verb in ("DIRECT.GET", "STREAM.MSG.GET", "STREAM.PURGE", "STREAM.DELETE", "STREAM.UPDATE",
                     "CONSUMER.CREATE"):
            api_subject = f"$JS.API.{verb}.{CALL_NONCES_STREAM}"
            assert await orchestrator.refused(lambda nc: nc.publish(api_subject, b"{}")), verb
    finally:
        for member in members:
            await member.nc.close()


async def test_connect_nats_logs_in_with_the_member_key_and_its_own_inbox(community_server):
    community, server = community_server
    settings = NatsSettings(url=server.url, creds_file=community.directory / "keys" / "alice.nk", connect_timeout_s=5)
    nc = await connect_nats(settings=settings, name="test-alice")
    try:
        assert nc.new_inbox().startswith("_INBOX.alice.")
        # A request through the member's own inbox works end to end (no responders: the broker answered).
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request("llm.models", b"{}", timeout=2)
    finally:
        await nc.close()


async def test_connect_nats_says_soon_that_the_broker_refused_unknown_credentials(community_server, tmp_path):
    _, server = community_server
    stranger = tmp_path / "stranger" / "keys" / "mallory.nk"
    MemberKey.generate().save(stranger)
    started = asyncio.get_running_loop().time()
    with pytest.raises(BrokerRefusedCredentials, match="refused the connection"):
        await connect_nats(settings=NatsSettings(url=server.url, creds_file=stranger, connect_timeout_s=10))
    # Long before the connect timeout: only the refusal grace (a reloading broker refuses briefly) is waited.
    assert asyncio.get_running_loop().time() - started < NatsSettings().refused_grace_s + 4


async def test_a_member_added_while_the_broker_runs_can_connect_at_once(community_server):
    community, server = community_server
    for index in range(5):  # the reload is asynchronous in nats-server: reload() must wait for it each time
        added = community.add(f"late-{index}", "client")
        server.reload(render_authorization(community.roster()))
        nc = await connect_nats(settings=NatsSettings(url=server.url, creds_file=added.seed_file,
                                                      connect_timeout_s=5))
        await nc.close()


async def test_members_connecting_while_others_are_added_are_not_refused(community_server):
    """nats-server can refuse a known key while it reloads its configuration (each `hearth community add` on a
    running mesh reloads it): connect_nats tries again within its refusal grace instead of giving up."""
    community, server = community_server
    settings = NatsSettings(url=server.url, creds_file=community.directory / "keys" / "alice.nk", connect_timeout_s=5)
    connects, reloads, reloading = 0, 0, True

    async def connect_while_reloading() -> None:
        nonlocal connects
        while reloading:
            nc = await connect_nats(settings=settings, name=f"test-alice-{connects}")
            await nc.close()
            connects += 1

    connecting = asyncio.create_task(connect_while_reloading())
    # Both sides keep going until each has done its share (a refused connect waits a while before it tries again).
    while (reloads < reloads_while_connecting or connects < reloads_while_connecting) and not connecting.done():
        community.add(f"joining-{reloads}", "client")
        await asyncio.to_thread(server.reload, render_authorization(community.roster()))
        reloads += 1
    reloading = False
    await asyncio.wait_for(connecting, 60)  # raises BrokerRefusedCredentials if a connect gave up
    assert connects >= reloads_while_connecting


async def test_a_reload_nats_server_refuses_is_said_at_once_and_the_old_users_stay(community_server):
    community, server = community_server
    started = asyncio.get_running_loop().time()
    with pytest.raises(NatsServerError, match="kept its previous configuration"):
        await asyncio.to_thread(server.reload, "authorization { users = [ {nkey: ")
    assert asyncio.get_running_loop().time() - started < server_start_timeout_s / 2
    await asyncio.to_thread(server.restart)  # the file holds the running configuration again: it starts
    nc = await connect_nats(settings=NatsSettings(url=server.url, creds_file=community.directory / "keys" / "alice.nk",
                                                  connect_timeout_s=5))
    await nc.close()


async def test_a_rotated_key_is_refused_at_login_and_its_connections_closed_while_the_new_key_logs_in(
        community_server, tmp_path):
    community, server = community_server
    await create_community_streams(NatsSettings(url=server.url), community.system_key_path, ready_timeout_s=10)
    leaked = tmp_path / "leaked" / "alice.nk"  # the copy whoever took the key kept
    MemberKey.load(community.directory / "keys" / "alice.nk").save(leaked)
    old_connection = await nats.connect(server.url, nkeys_seed_str=leaked.read_text(), inbox_prefix="_INBOX.alice",
                                        allow_reconnect=False, connect_timeout=2)
    rotated, published = await asyncio.to_thread(
        rotate_member_key, community, "alice", public_key=None, nats_url=server.url, settings=HearthSettings(),
        offline=False)
    assert [cut.stream for cut in rotated.retired.cuts] == list(ALL_STREAMS) and published.failures == {}
    await asyncio.to_thread(server.reload, render_authorization(community.roster()))
    with pytest.raises(BrokerRefusedCredentials, match="refused the connection"):
        await connect_nats(settings=NatsSettings(url=server.url, creds_file=leaked, connect_timeout_s=5))
    for _ in range(100):  # nats-server closes a connection whose user a reload removed
        if old_connection.is_closed:
            break
        await asyncio.sleep(0.1)
    assert old_connection.is_closed
    nc = await connect_nats(settings=NatsSettings(url=server.url, creds_file=rotated.seed_file, connect_timeout_s=5))
    try:
        assert nc.new_inbox().startswith("_INBOX.alice.")
    finally:
        await nc.close()

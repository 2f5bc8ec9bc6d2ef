"""A shard host's key rotated while it runs (`hearth community rotate-key`): its withdrawal, which the broker no longer
takes from the old key, is kept in its outbox at once, with no wait for a broker that refuses the key (nor for the
host's connection and stream readers to wind down on it), and the node's next host (the new key) does not send it
signed by the retired key, so an audit after an ordinary rotation finds nothing wrong (hearth/events/outbox.py,
hearth/services/broker/connection.py, hearth/events/ordered_reader.py)."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest
from typer.testing import CliRunner

from hearth.events.models import ShardWithdrawn
from hearth.events.signing import EventVerifier
from hearth.events.streams import ALL_STREAMS
from hearth.protocol.subjects import shard_control_subject
from hearth.events import ordered_reader
from hearth.events.ordered_reader import OrderedPushReader
from hearth.events.outbox_file import OutboxFile
from hearth.events.streams import SHARDS_STREAM
from hearth.services.broker.connection import connect_nats, drain_or_close, key_refused_event
from hearth.services.broker.permissions import render_authorization
from hearth.services.common.config import NatsSettings
from hearth.services.community_cli import community_app
from hearth.services.replay.verify import verify_streams
from hearth.services.shard.kept_events import say_once, shard_outbox, start_outbox
from hearth.trust.keys import MemberKey
from tests.community_log import as_auditor, community_on_a_broker
from tests.readmodel_helpers import advertised

pytestmark = pytest.mark.integration
NEVER_S = 600.0  # each wait's own timeout: the refusal, not this, ends them
SOON_S = 4.0  # below the 5 s a JetStream request on the refused connection would wait


@pytest.fixture
def community_broker(tmp_path):
    with community_on_a_broker(tmp_path, (("attic", "shard"), ("eve", "auditor"))) as (community, server):
        yield community, server


async def rotate_attic(community, server) -> None:
    rotated = await asyncio.to_thread(CliRunner().invoke, community_app, [
        "rotate-key", "attic", "--dir", str(community.directory), "--nats", server.url])
    assert rotated.exit_code == 0, rotated.output
    server.reload(render_authorization(community.roster()))  # what `hearth nats --community` does at once


async def connect_as(url: str, seed_file):
    return await connect_nats(url, name="test-attic", settings=NatsSettings(url=url, creds_file=seed_file,
                                                                            connect_timeout_s=5, reconnect_wait_s=0.1))


async def test_a_withdrawal_kept_across_a_rotation_of_the_hosts_key_is_dropped_not_sent_under_the_retired_key(
        community_broker, tmp_path, caplog):
    community, server = community_broker
    old_seed = tmp_path / "host" / "attic.nk"  # the host's own copy: the rotation deletes the steward's
    old_seed.parent.mkdir(mode=0o700)
    shutil.copy(community.directory / "keys" / "attic.nk", old_seed)
    outbox_dir = tmp_path / "shard-outbox"
    advert = advertised(0, 3, "attic")
    advert = advert.model_copy(update={"control_subject": shard_control_subject("attic", advert.shard_id)})

    running = await connect_as(server.url, old_seed)
    try:
        outbox = shard_outbox(running, MemberKey.load(old_seed))
        await start_outbox(outbox, outbox_dir, "attic", timeout_s=1)
        assert await say_once(outbox, advert, timeout_s=5)
        await rotate_attic(community, server)
        # Stopping: the broker refuses the old key, so the withdrawal is kept for the node's next host.
        withdrawal = ShardWithdrawn(node_id="attic", shard_id=advert.shard_id, reason="shutdown")
        assert not await say_once(outbox, withdrawal, timeout_s=0.5)
        await outbox.stop(0.0)
    finally:
        await running.close()

    restarted = await connect_as(server.url, community.directory / "keys" / "attic.nk")
    try:
        outbox = shard_outbox(restarted, MemberKey.load(community.directory / "keys" / "attic.nk"))
        with caplog.at_level(logging.WARNING, logger="hearth.events.outbox"):
            await start_outbox(outbox, outbox_dir, "attic", timeout_s=5)
        assert outbox.depth == 0
        await outbox.stop(1.0)
    finally:
        await restarted.close()

    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    report = await as_auditor(community, server.url, lambda js: verify_streams(js, verifier, ALL_STREAMS))
    assert [(bad.stream, bad.seq, bad.reason) for bad in report.bad] == []
    assert "1 event(s) a previous run left signed by a key this process does not hold" in caplog.text


async def test_a_host_whose_key_the_broker_refuses_waits_for_nothing_it_cannot_send_as_it_stops(
        community_broker, tmp_path, monkeypatch):
    community, server = community_broker
    monkeypatch.setattr(ordered_reader, "consumer_delete_timeout_s", NEVER_S)
    old_seed = tmp_path / "host" / "attic.nk"
    old_seed.parent.mkdir(mode=0o700)
    shutil.copy(community.directory / "keys" / "attic.nk", old_seed)
    advert = advertised(0, 3, "attic")
    running = await connect_as(server.url, old_seed)
    outbox = shard_outbox(running, MemberKey.load(old_seed))
    await start_outbox(outbox, tmp_path / "shard-outbox", "attic", timeout_s=1)
    reader = OrderedPushReader(running.jetstream(), SHARDS_STREAM, start_seq=1, start_time=None, filters=[],
                               follow=True, idle_timeout_s=NEVER_S)
    await reader.open()
    await rotate_attic(community, server)
    async with asyncio.timeout(SOON_S):
        await key_refused_event(running).wait()

    async with asyncio.timeout(SOON_S):  # what a stopping host does, each given far longer than this
        withdrawal = ShardWithdrawn(node_id="attic", shard_id=advert.shard_id, reason="shutdown")
        assert not await say_once(outbox, withdrawal, timeout_s=NEVER_S)
        await outbox.stop(0.0)
        await reader.close()
        await drain_or_close(running, NEVER_S)
    assert running.is_closed
    kept = await asyncio.to_thread(OutboxFile.claim, tmp_path / "shard-outbox", "attic")
    try:
        assert [left.event.event_id for left in kept.left] == [withdrawal.event_id]  # for the node's next host
    finally:
        kept.close()

"""The steward's key rotated on a real community broker (`hearth community rotate-key system --nats`): the old key
publishes the rotation on each stream, the broker (once the roster is applied, as `hearth nats --community` does at
once) refuses the old key and admits the new, the broker's own consumer sweep logs in again with the new seed and
goes on sweeping, and an audit of the log passes every event, the rotation signed by the old key included."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from typer.testing import CliRunner

from hearth.events.consume import read_stream
from hearth.events.models import MemberKeyRotated
from hearth.events.signing import EventVerifier
from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM
from hearth.services.broker.connection import BrokerRefusedCredentials, connect_nats
from hearth.services.broker.consumer_sweep import ConsumerSweeper, listed_consumers
from hearth.services.broker.permissions import render_authorization
from hearth.services.common.config import NatsSettings
from hearth.services.community_cli import community_app
from hearth.services.replay.verify import verify_streams
from hearth.trust.roster import SYSTEM_MEMBER
from tests.community_log import community_on_a_broker

pytestmark = pytest.mark.integration
SWEEP_WAIT_S = 15.0


@pytest.fixture
def community_broker(tmp_path):
    with community_on_a_broker(tmp_path, (("eve", "auditor"),)) as (community, server):
        yield community, server


async def connect_with(url: str, seed_file, name: str):
    return await connect_nats(url, name=name, settings=NatsSettings(url=url, creds_file=seed_file,
                                                                    connect_timeout_s=5))


async def removal_events(js, stream: str) -> list:
    messages = read_stream(js, stream, subject_filter=MEMBER_REMOVAL_SUBJECTS[stream], follow=False)
    return [message.event async for message in messages]


async def test_broker_sweeper_and_log_follow_the_stewards_new_key(community_broker, tmp_path):
    community, server = community_broker
    old_key = community.system_key()
    old_copy = tmp_path / "leaked" / "system.nk"  # no roster beside it: the broker alone judges it
    old_copy.parent.mkdir(mode=0o700)
    shutil.copy(community.system_key_path, old_copy)
    sweeper = ConsumerSweeper(NatsSettings(url=server.url, roster_file=community.roster_path),
                              community.system_key_path, community.roster_path, report=lambda swept: None,
                              interval_s=0.2).start()
    eve = await connect_with(server.url, community.directory / "keys" / "eve.nk", "test-eve")
    try:
        await asyncio.sleep(0.5)  # the sweep logs in with the old key
        result = await asyncio.to_thread(CliRunner().invoke, community_app, [
            "rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--nats", server.url])
        assert result.exit_code == 0, result.output
        server.reload(render_authorization(community.roster()))  # what `hearth nats --community` does at once

        with pytest.raises(BrokerRefusedCredentials):
            await connect_with(server.url, old_copy, "test-old-steward")
        steward = await connect_with(server.url, community.system_key_path, "test-new-steward")
        try:
            name = "pushes-elsewhere"
            await eve.jetstream().add_consumer(PIPELINES_STREAM, ConsumerConfig(
                name=name, ack_policy=AckPolicy.NONE, deliver_subject="hearth.act.somewhere"))
            deadline = asyncio.get_running_loop().time() + SWEEP_WAIT_S
            while name in {entry["name"] for entry in await listed_consumers(steward, PIPELINES_STREAM)}:
                assert asyncio.get_running_loop().time() < deadline, "the sweep never logged in with the new key"
                await asyncio.sleep(0.1)

            js = steward.jetstream()
            for stream in ALL_STREAMS:
                [rotation] = await removal_events(js, stream)
                assert isinstance(rotation, MemberKeyRotated)
                assert (rotation.signer, rotation.new_public_key) == (old_key.public_key,
                                                                      community.system_key().public_key)
            verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
            report = await verify_streams(js, verifier, ALL_STREAMS)
            assert report.bad == []
        finally:
            await steward.close()
    finally:
        await asyncio.to_thread(sweeper.stop)
        await eve.close()

"""Member changes the roster holds but the event log lacks (`add`, `rotate-key` and `remove` run with --offline, or
with the broker out of reach or a stream refusing) are published later by `hearth community publish-pending`, on a real
community broker: each stream gets, in order, what its log lacks and nothing it holds already, and a household whose
roster copy is older than every change follows them from the log. Before, nothing could publish them: `add` again
was refused (the roster names the member), and `remove` and `rotate-key` again found the roster already changed."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from typer.testing import CliRunner

from hearth.events.streams import ALL_STREAMS
from hearth.services.broker.connection import connect_nats
from hearth.services.common.call_signing import CallRefused, signed_call_headers
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.common.event_trust import (
    member_public_keys, node_membership, open_verifier, steward_keys_from_the_log,
)
from hearth.services.community_cli import community_app
from hearth.trust.keys import MemberKey
from tests.community_log import community_on_a_broker

pytestmark = pytest.mark.integration
MEMBERS = (("hub", "orchestrator"), ("attic", "shard"), ("shed", "shard"))


def test_changes_made_offline_are_published_later_once_each_and_a_household_with_the_old_roster_follows_them(
        tmp_path):
    with community_on_a_broker(tmp_path, MEMBERS) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"  # handed out before any change below
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        garage, attic_2 = MemberKey.generate(), MemberKey.generate()

        def steward(*args: str, nats: bool = False):
            where = ["--nats", server.url] if nats else []
            return CliRunner().invoke(community_app, [*args, "--dir", str(community.directory), *where])

        for change in (["add", "--name", "garage", "--role", "orchestrator", "--public-key", garage.public_key],
                       ["rotate-key", "attic", "--public-key", attic_2.public_key], ["remove", "--name", "shed"]):
            done = steward(*change, "--offline")
            assert done.exit_code == 0, done.output
        again = steward("add", "--name", "garage", "--role", "orchestrator", "--public-key", garage.public_key,
                        nats=True)
        assert again.exit_code == 1 and "publish-pending" in again.output, again.output
        listed = " ".join(steward("list").output.split())
        for lacking in ("garage: its addition", "attic: its key rotation", "shed: its removal"):
            assert lacking in listed, listed

        published = steward("publish-pending", nats=True)
        assert published.exit_code == 0, published.output
        said = " ".join(published.output.split())
        for stream in ALL_STREAMS:
            for change in ("the addition of garage", "the rotation of attic's key", "the removal of shed"):
                assert f"{stream}: published {change}" in said, said
        settings = HearthSettings(nats=NatsSettings(url=server.url, roster_file=household_roster,
                                                    creds_file=community.directory / "keys" / "hub.nk"))

        async def household() -> tuple:
            connection = await connect_nats(server.url, name="test-hub", settings=settings.nats)
            follower = steward_keys_from_the_log(settings, connection.jetstream(), ALL_STREAMS)
            try:
                await follower.start()
                opens = open_verifier(settings, follower)
                checked = opens.check("hearth.ctl.attic.x", "", b"{}",
                                      signed_call_headers(garage, "hearth.ctl.attic.x", "", b"{}"))
                membership, sealed_to = node_membership(settings, follower), member_public_keys(settings, follower)
                return (checked.reason if isinstance(checked, CallRefused) else checked.name,
                        sealed_to("attic"), membership("shed"))
            finally:
                await follower.stop()
                await connection.close()

        opener, attic_sealed_to, shed = asyncio.run(household())
        assert (opener, attic_sealed_to) == ("garage", attic_2.public_key)
        assert shed is not None and "removed" in shed

        rerun = steward("publish-pending", nats=True)
        assert rerun.exit_code == 0, rerun.output
        assert "published" not in rerun.output
        assert all(f"{stream}: holds every change" in " ".join(rerun.output.split()) for stream in ALL_STREAMS)
        assert "publish-pending" not in steward("list").output

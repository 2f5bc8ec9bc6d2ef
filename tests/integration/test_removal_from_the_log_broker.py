"""A household still holding the roster from before `hearth community remove` (or `rotate-key`) stops taking the
member's calls and opens, and stops routing to its shards, as soon as the event log it follows shows the removal, on
a real community broker. Before, an orchestrator and a shard host read the removals subjects but used them only for
the steward's own key: a removed client's calls, a removed orchestrator's opens and a removed host's shards were
taken until the household got the new roster.json (and the host's shards until their heartbeats aged, 30 s)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from typer.testing import CliRunner

from hearth.events.streams import ALL_STREAMS, SHARDS_STREAM
from hearth.services.broker.connection import connect_nats
from hearth.services.common.call_signing import CallRefused, signed_call_headers
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.common.event_trust import (
    call_verifier, node_membership, open_verifier, steward_keys_from_the_log,
)
from hearth.services.community_cli import community_app
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster
from tests.community_log import community_on_a_broker

pytestmark = pytest.mark.integration
MEMBERS = (("hub", "orchestrator"), ("hub2", "orchestrator"), ("attic", "shard"), ("alice", "client"),
           ("bob", "client"))


def steward(*args: str):
    return CliRunner().invoke(community_app, list(args))


def test_a_household_with_the_old_roster_refuses_a_removed_members_calls_opens_and_shards_once_the_log_says_so(
        tmp_path):
    with community_on_a_broker(tmp_path, MEMBERS) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"  # the copy the household was handed before
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        keys = {name: MemberKey.load(community.directory / "keys" / f"{name}.nk") for name, _ in MEMBERS}

        def settings_of(member: str) -> HearthSettings:
            return HearthSettings(nats=NatsSettings(url=server.url, roster_file=household_roster,
                                                    creds_file=community.directory / "keys" / f"{member}.nk"))

        def signer(verifier, key, subject: str, reply: str) -> str:
            checked = verifier.check(subject, reply, b"{}", signed_call_headers(key, subject, reply, b"{}"))
            return checked.reason if isinstance(checked, CallRefused) else checked.name

        async def as_member(member: str, streams, work):
            settings = settings_of(member)
            connection = await connect_nats(server.url, name=f"test-{member}", settings=settings.nats)
            follower = steward_keys_from_the_log(settings, connection.jetstream(), streams)
            try:
                await follower.start()
                return await work(settings, follower)
            finally:
                await follower.stop()
                await connection.close()

        async def retired_in_the_log(follower, *names: str) -> None:
            async with asyncio.timeout(10):
                while not {keys[name].public_key for name in names} <= follower.retired_keys():
                    await asyncio.sleep(0.05)

        async def orchestrator(settings, follower):
            calls = call_verifier(settings, follower)
            membership = node_membership(settings, follower)
            call = ("llm.chat.request", "_INBOX.alice.x")
            before = (signer(calls, keys["alice"], *call), membership("attic"))
            for removed in ("alice", "attic"):
                result = await asyncio.to_thread(steward, "remove", "--name", removed, "--dir",
                                                 str(community.directory), "--nats", server.url)
                assert result.exit_code == 0, result.output
            rotated = await asyncio.to_thread(steward, "rotate-key", "bob", "--dir", str(community.directory),
                                              "--nats", server.url)
            assert rotated.exit_code == 0, rotated.output
            await retired_in_the_log(follower, "alice", "attic", "bob")
            after = (signer(calls, keys["alice"], *call), signer(calls, keys["bob"], "llm.chat.request",
                                                                  "_INBOX.bob.x"), membership("attic"))
            return before, after

        before, after = asyncio.run(as_member("hub", ALL_STREAMS, orchestrator))
        assert before == ("alice", None)
        assert after[:2] == ("unknown_signer", "unknown_signer")
        assert after[2] is not None and "removed" in after[2]

        async def shard_host(settings, follower):
            opens = open_verifier(settings, follower)
            opening = ("hearth.ctl.attic.x", "")
            before = signer(opens, keys["hub2"], *opening)
            removed = await asyncio.to_thread(steward, "remove", "--name", "hub2", "--dir", str(community.directory),
                                              "--nats", server.url)
            assert removed.exit_code == 0, removed.output
            await retired_in_the_log(follower, "hub2")
            return before, signer(opens, keys["hub2"], *opening), signer(opens, keys["hub"], *opening)

        assert asyncio.run(as_member("hub", (SHARDS_STREAM,), shard_host)) == ("hub2", "unknown_signer", "hub")
        # The household's roster never changed: the log alone told it.
        assert all(Roster.load(household_roster).by_name(name) is not None for name, _ in MEMBERS)

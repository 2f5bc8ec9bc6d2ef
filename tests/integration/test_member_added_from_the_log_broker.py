"""A household still holding the roster from before `hearth community add` takes the new member's calls, opens and
shards as soon as the event log it follows shows the addition, on a real community broker. Before, the new client's
calls and the new orchestrator's opens were refused (unknown_signer) and the new host's shards not routed until the
household got the new roster.json. So is a key rotation of such a member: before, the household followed a rotation
only from a key its roster named, and refused the added member's new key."""

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
    call_verifier, member_public_keys, node_membership, open_verifier, steward_keys_from_the_log,
)
from hearth.services.community_cli import community_app
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster
from tests.community_log import community_on_a_broker

pytestmark = pytest.mark.integration
MEMBERS = (("hub", "orchestrator"), ("attic", "shard"))
ADDED = (("carol", "client"), ("hub3", "orchestrator"), ("garage", "shard"))


def test_a_household_with_the_old_roster_takes_an_added_members_calls_opens_and_shards_once_the_log_says_so(
        tmp_path):
    with community_on_a_broker(tmp_path, MEMBERS) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"  # the copy the household was handed before
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        settings = HearthSettings(nats=NatsSettings(url=server.url, roster_file=household_roster,
                                                    creds_file=community.directory / "keys" / "hub.nk"))

        def signer(verifier, key, subject: str, reply: str) -> str:
            checked = verifier.check(subject, reply, b"{}", signed_call_headers(key, subject, reply, b"{}"))
            return checked.reason if isinstance(checked, CallRefused) else checked.name

        async def household() -> tuple[tuple, tuple]:
            connection = await connect_nats(server.url, name="test-hub", settings=settings.nats)
            follower = steward_keys_from_the_log(settings, connection.jetstream(), ALL_STREAMS)
            try:
                await follower.start()
                calls, opens = call_verifier(settings, follower), open_verifier(settings, follower)
                membership, sealed_to = node_membership(settings, follower), member_public_keys(settings, follower)
                keys = {name: MemberKey.generate() for name, _ in ADDED}

                def seen() -> tuple:
                    return (signer(calls, keys["carol"], "llm.chat.request", "_INBOX.carol.x"),
                            signer(opens, keys["hub3"], "hearth.ctl.attic.x", ""), membership("garage"),
                            sealed_to("garage"))

                before = seen()
                for name, role in ADDED:
                    added = await asyncio.to_thread(
                        CliRunner().invoke, community_app, ["add", "--name", name, "--role", role, "--public-key",
                                                            keys[name].public_key, "--dir", str(community.directory),
                                                            "--nats", server.url])
                    assert added.exit_code == 0, added.output
                    assert "from the event log" in " ".join(added.output.split())
                async with asyncio.timeout(10):
                    while len(follower.member_additions()) < len(ADDED) * len(ALL_STREAMS):
                        await asyncio.sleep(0.05)
                return before, (*seen(), keys["garage"].public_key)
            finally:
                await follower.stop()
                await connection.close()

        before, after = asyncio.run(household())
        assert before[:2] == ("unknown_signer", "unknown_signer") and "not a member" in before[2]
        assert before[3] is None
        assert after[:4] == ("carol", "hub3", None, after[4])
        # The household's roster never changed: the log alone told it.
        assert Roster.load(household_roster).by_name("carol") is None


def test_a_household_with_the_old_roster_follows_an_added_members_key_rotation(tmp_path):
    """`add`, then `rotate-key`: the household follows the new key from the rotation in the log, as for a member its
    roster names. Before, the new key's calls were unknown_signer until the household had the new roster."""
    with community_on_a_broker(tmp_path, MEMBERS) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        settings = HearthSettings(nats=NatsSettings(url=server.url, roster_file=household_roster,
                                                    creds_file=community.directory / "keys" / "hub.nk"))
        old, new = MemberKey.generate(), MemberKey.generate()

        def steward(*args: str) -> None:
            done = CliRunner().invoke(community_app, [*args, "--dir", str(community.directory), "--nats", server.url])
            assert done.exit_code == 0, done.output

        async def household() -> tuple:
            connection = await connect_nats(server.url, name="test-hub", settings=settings.nats)
            follower = steward_keys_from_the_log(settings, connection.jetstream(), ALL_STREAMS)
            try:
                await follower.start()
                await asyncio.to_thread(steward, "add", "--name", "garage", "--role", "shard", "--public-key",
                                        old.public_key)
                await asyncio.to_thread(steward, "rotate-key", "garage", "--public-key", new.public_key)
                async with asyncio.timeout(10):
                    while len(follower.member_keys()) < len(ALL_STREAMS):
                        await asyncio.sleep(0.05)
                calls, opens = call_verifier(settings, follower), open_verifier(settings, follower)
                checked = [verifier.check("hearth.ctl.attic.x", "", b"{}",
                                          signed_call_headers(key, "hearth.ctl.attic.x", "", b"{}"))
                           for verifier in (calls, opens) for key in (new, old)]
                return ([getattr(one, "reason", None) or one.name for one in checked],
                        node_membership(settings, follower)("garage"), member_public_keys(settings, follower)("garage"))
            finally:
                await follower.stop()
                await connection.close()

        checked, membership, sealed_to = asyncio.run(household())
        # A shard host's key calls nothing (its role), but it is garage's; the retired key is no one's.
        assert checked == ["role_may_not_call", "unknown_signer", "garage", "unknown_signer"]
        assert (membership, sealed_to) == (None, new.public_key)
        assert Roster.load(household_roster).by_name("garage") is None

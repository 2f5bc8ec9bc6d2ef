"""A household still holding the roster from before `hearth community rotate-key system` follows the steward's new
key from the log on a real community broker: its projector (restarted in between), a rebuild and `hearth-replay
verify` all apply the removal the new steward key signs, and reach the same read model. Before, that removal was
`unknown_signer` in every one of them until the household got the new roster.json."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from hearth.events.signing import EventVerifier, RosterFile
from hearth.events.streams import ALL_STREAMS
from hearth.readmodels.db import open_engine, upgrade_database
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.tables import MemberRemoval, RejectedEvent, StewardKey
from hearth.services.broker.permissions import render_authorization
from hearth.services.community_cli import community_app
from hearth.services.replay.verify import verify_streams
from hearth.trust.roster import SYSTEM_MEMBER, Roster
from tests.community_log import apply_new_messages, as_auditor, as_steward, community_on_a_broker

pytestmark = pytest.mark.integration


def steward(*args: str):
    return CliRunner().invoke(community_app, list(args))


def rows(path, table) -> list:
    engine = open_engine(path)
    try:
        with Session(engine) as session:
            return list(session.scalars(select(table)))
    finally:
        engine.dispose()


def test_a_household_with_the_old_roster_applies_what_the_new_steward_key_signs(tmp_path):
    with community_on_a_broker(tmp_path, (("eve", "auditor"), ("attic", "shard"))) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"  # the copy every member was handed before
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        old_key = community.system_key().public_key
        live = tmp_path / "live.sqlite"
        upgrade_database(live)

        rotated = steward("rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--nats", server.url)
        assert rotated.exit_code == 0, rotated.output
        server.reload(render_authorization(community.roster()))  # what `hearth nats --community` does at once
        new_key = community.system_key().public_key
        apply_new_messages(community, server.url, live,
                           EventVerifier(RosterFile(household_roster), max_clock_skew_s=30))

        attic_key = community.roster().by_name("attic").public_key
        removed = steward("remove", "--name", "attic", "--dir", str(community.directory), "--nats", server.url)
        assert removed.exit_code == 0, removed.output
        # A projector started afresh with the same old roster: what it learnt is in its read model.
        apply_new_messages(community, server.url, live,
                           EventVerifier(RosterFile(household_roster), max_clock_skew_s=30))

        assert Roster.load(household_roster).by_name(SYSTEM_MEMBER).public_key == old_key
        assert rows(live, RejectedEvent) == []
        assert {(row.member, row.public_key) for row in rows(live, MemberRemoval)} == {
            (SYSTEM_MEMBER, old_key), ("attic", attic_key)}
        assert {(row.stream, row.public_key, row.succeeds) for row in rows(live, StewardKey)} == {
            (stream, new_key, old_key) for stream in ALL_STREAMS}

        verifier = EventVerifier(Roster.load(household_roster), max_clock_skew_s=30)
        fresh = tmp_path / "fresh.sqlite"
        asyncio.run(as_auditor(community, server.url, lambda js: rebuild_database(js, fresh, verifier=verifier)))
        assert diff_databases(fresh, live) == []
        report = asyncio.run(as_auditor(community, server.url, lambda js: verify_streams(js, verifier, ALL_STREAMS)))
        assert report.bad == []


def test_calls_and_opens_follow_the_stewards_rotation_in_the_log_with_the_old_roster(tmp_path):
    """An orchestrator following the log while the steward rotates its key, and a shard host started after it, both
    with the roster from before: the old steward key's call and open are refused, the new one's accepted. Before,
    both went by the roster alone (the retired key accepted, the new one `unknown_signer`)."""
    from hearth.services.broker.connection import connect_nats
    from hearth.services.common.call_signing import CallRefused, signed_call_headers
    from hearth.services.common.config import HearthSettings, NatsSettings
    from hearth.services.common.event_trust import call_verifier, open_verifier, steward_keys_from_the_log
    from hearth.events.streams import SHARDS_STREAM

    with community_on_a_broker(tmp_path, (("hub", "orchestrator"), ("attic", "shard"))) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        old_key = community.system_key()

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

        async def orchestrator(settings, follower):
            verifier = call_verifier(settings, follower)
            call = ("llm.chat.request", "_INBOX.system.x")
            before = signer(verifier, old_key, *call)
            rotated = await asyncio.to_thread(steward, "rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory),
                                              "--nats", server.url)
            assert rotated.exit_code == 0, rotated.output
            async with asyncio.timeout(10):
                while len(follower.named()) < len(ALL_STREAMS):  # the rotation, as each stream stores it
                    await asyncio.sleep(0.05)
            return before, signer(verifier, old_key, *call), signer(verifier, community.system_key(), *call)

        assert asyncio.run(as_member("hub", ALL_STREAMS, orchestrator)) == (
            SYSTEM_MEMBER, "unknown_signer", SYSTEM_MEMBER)

        async def shard_host(settings, follower):
            verifier = open_verifier(settings, follower)
            opening = ("hearth.ctl.attic.x", "")
            return signer(verifier, old_key, *opening), signer(verifier, community.system_key(), *opening)

        assert asyncio.run(as_member("attic", (SHARDS_STREAM,), shard_host)) == ("unknown_signer", SYSTEM_MEMBER)
        assert Roster.load(household_roster).by_name(SYSTEM_MEMBER).public_key == old_key.public_key


def test_a_shard_host_started_after_the_rotation_left_the_stream_trusts_the_key_it_kept(tmp_path):
    """A shard host learns the steward's rotation from the shards stream and keeps it in its state folder; the
    rotation then leaves the stream (as it does after 7 days), and a host started afresh with the roster from before
    still counts the new steward key, not the old one. Before, nothing was kept: it went back to the roster's key."""
    from hearth.services.broker.connection import connect_nats
    from hearth.services.common.call_signing import CallRefused, signed_call_headers
    from hearth.services.common.config import HearthSettings, NatsSettings
    from hearth.services.common.event_trust import open_verifier, steward_keys_from_the_log
    from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, SHARDS_STREAM

    with community_on_a_broker(tmp_path, (("attic", "shard"),)) as (community, server):
        household_roster = tmp_path / "household" / "roster.json"
        household_roster.parent.mkdir()
        shutil.copy(community.roster_path, household_roster)
        old_key = community.system_key()
        state = tmp_path / "attic-state"
        settings = HearthSettings(nats=NatsSettings(url=server.url, roster_file=household_roster,
                                                    creds_file=community.directory / "keys" / "attic.nk"))

        async def shard_host(state_folder, learn_rotation: bool = False):
            connection = await connect_nats(server.url, name="test-attic", settings=settings.nats)
            follower = steward_keys_from_the_log(settings, connection.jetstream(), (SHARDS_STREAM,), state_folder)
            try:
                await follower.start()
                if learn_rotation:
                    async with asyncio.timeout(10):
                        while not (state_folder / "steward-keys.json").is_file():
                            await asyncio.sleep(0.05)
                verifier = open_verifier(settings, follower)
                return [verifier.check("hearth.ctl.attic.x", "", b"{}",
                                       signed_call_headers(key, "hearth.ctl.attic.x", "", b"{}"))
                        for key in (old_key, community.system_key())]
            finally:
                await follower.stop()
                await connection.close()

        def signers(checked) -> list[str]:
            return [check.reason if isinstance(check, CallRefused) else check.name for check in checked]

        rotated = steward("rotate-key", SYSTEM_MEMBER, "--dir", str(community.directory), "--nats", server.url)
        assert rotated.exit_code == 0, rotated.output
        server.reload(render_authorization(community.roster()))
        assert signers(asyncio.run(shard_host(state, learn_rotation=True))) == ["unknown_signer", SYSTEM_MEMBER]

        async def age_out(js):
            await js.purge_stream(SHARDS_STREAM, subject=MEMBER_REMOVAL_SUBJECTS[SHARDS_STREAM])

        asyncio.run(as_steward(community, server.url, age_out))
        # Without the kept file the roster's (old) key is the steward's again: the defect this file mends.
        assert signers(asyncio.run(shard_host(None))) == [SYSTEM_MEMBER, "unknown_signer"]
        assert signers(asyncio.run(shard_host(state))) == ["unknown_signer", SYSTEM_MEMBER]

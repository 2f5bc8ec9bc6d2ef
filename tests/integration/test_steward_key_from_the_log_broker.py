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
from tests.community_log import apply_new_messages, as_auditor, community_on_a_broker

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

"""A member's removal through a real community broker: `hearth community remove` publishes a signed `member.removed`
on each stream and records where; a live read model, a rebuild under a roster whose removal time is off by an hour,
and `hearth-replay verify` all cut the removed host off at that position and nowhere else."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from hearth.events.envelope import utc_now
from hearth.events.publish import publish_event
from hearth.events.signing import EventVerifier, RosterFile
from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import shard_control_subject
from hearth.readmodels.db import open_engine, upgrade_database
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.tables import RejectedEvent
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import NatsSettings
from hearth.services.community_cli import community_app
from hearth.services.replay.verify import verify_streams
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster
from tests.community_log import apply_new_messages, as_auditor, as_steward, community_on_a_broker
from tests.readmodel_helpers import advertised, heartbeat

pytestmark = pytest.mark.integration
ATTIC_SHARD = advertised(0, 3, "attic").shard_id


@pytest.fixture
def community_broker(tmp_path):
    # The authorization is rendered once and never reloaded: the removed host keeps publishing, as it may into a
    # broker the steward reloads by hand, and the cut alone keeps its later events out.
    with community_on_a_broker(tmp_path, (("attic", "shard"), ("eve", "auditor"))) as (community, server):
        yield community, server, (community.directory / "keys" / "attic.nk").read_text()


async def publish_as_attic(url: str, seed_file, events) -> None:
    connection = await connect_nats(url, name="test-attic", settings=NatsSettings(url=url, creds_file=seed_file))
    try:
        for event in events:
            await publish_event(connection.jetstream(), event.model_copy(update={"occurred_at": utc_now()}),
                                signing_key=MemberKey.load(seed_file))
    finally:
        await connection.close()


def rejected(path) -> list[tuple[str, int, str]]:
    engine = open_engine(path)
    with Session(engine) as session:
        rows = [(row.stream, row.stream_seq, row.reason) for row in session.scalars(select(RejectedEvent))]
    engine.dispose()
    return rows


def test_a_removal_through_a_community_broker_cuts_at_its_event_live_in_a_rebuild_and_in_an_audit(
        community_broker, tmp_path):
    community, server, attic_seed = community_broker
    seed_file = tmp_path / "attic.nk"  # the removal deletes the steward's copy; the host keeps its own
    seed_file.write_text(attic_seed)
    seed_file.chmod(0o600)
    advert = advertised(0, 3, "attic", control_subject=shard_control_subject("attic", ATTIC_SHARD))
    asyncio.run(publish_as_attic(server.url, seed_file, [advert, *(heartbeat(ATTIC_SHARD, node="attic", tokens=n)
                                                                   for n in (1, 2))]))
    live = tmp_path / "live.sqlite"
    upgrade_database(live)
    live_verifier = EventVerifier(RosterFile(community.roster_path), max_clock_skew_s=30)
    apply_new_messages(community, server.url, live, live_verifier)

    removed = CliRunner().invoke(community_app, ["remove", "--name", "attic", "--dir", str(community.directory),
                                                 "--nats", server.url])
    assert removed.exit_code == 0, removed.output
    # attic was added before the log: each stream gets its addition first (#4, #1), then its removal.
    assert f"{SHARDS_STREAM}: published the addition of attic at #4 first" in removed.output
    assert f"its removal is at {SHARDS_STREAM} #5, {PIPELINES_STREAM} #2" in removed.output
    cuts = {cut.stream: cut.seq for cut in community.roster().removed[0].cuts}
    assert cuts == {SHARDS_STREAM: 5, PIPELINES_STREAM: 2}

    asyncio.run(publish_as_attic(server.url, seed_file, [heartbeat(ATTIC_SHARD, node="attic", tokens=n)
                                                         for n in (3, 4)]))
    apply_new_messages(community, server.url, live, live_verifier)
    after_the_removal = [(SHARDS_STREAM, 6, "removed_signer"), (SHARDS_STREAM, 7, "removed_signer")]
    assert rejected(live) == after_the_removal

    # The steward's clock was an hour fast: the removal time in the roster is wrong, the cut is not.
    roster = community.roster()
    gone = roster.removed[0]
    roster.model_copy(update={"removed": [gone.model_copy(update={"removed_at": gone.removed_at + timedelta(hours=1)})]}
                      ).save(community.roster_path)
    verifier = EventVerifier(Roster.load(community.roster_path), max_clock_skew_s=30)
    fresh = tmp_path / "fresh.sqlite"
    asyncio.run(as_auditor(community, server.url, lambda js: rebuild_database(js, fresh, verifier=verifier)))
    assert rejected(fresh) == after_the_removal
    assert diff_databases(fresh, live) == []

    report = asyncio.run(as_auditor(community, server.url, lambda js: verify_streams(js, verifier, ALL_STREAMS)))
    assert [(bad.stream, bad.seq, bad.reason) for bad in report.bad] == after_the_removal


def remove_attic(community, url):
    return CliRunner().invoke(community_app, ["remove", "--name", "attic", "--dir", str(community.directory),
                                              "--nats", url])


def test_a_removal_run_again_keeps_the_first_runs_cut_even_once_that_event_has_aged_out(
        community_broker, tmp_path, monkeypatch):
    """The first run's removal events went in but its roster write failed; attic published meanwhile. The rerun
    records the first run's positions, publishing nothing, so a rebuild after the first removal event left the
    stream's retention rejects what attic published between the runs, as the live projection did."""
    community, server, attic_seed = community_broker
    seed_file = tmp_path / "attic.nk"
    seed_file.write_text(attic_seed)
    seed_file.chmod(0o600)
    advert = advertised(0, 3, "attic", control_subject=shard_control_subject("attic", ATTIC_SHARD))
    asyncio.run(publish_as_attic(server.url, seed_file, [advert, heartbeat(ATTIC_SHARD, node="attic", tokens=1)]))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(Community, "remove", disk_full)
        failed = remove_attic(community, server.url)
    assert failed.exit_code != 0 and community.roster().by_name("attic") is not None
    between_the_runs = utc_now()
    asyncio.run(publish_as_attic(server.url, seed_file, [heartbeat(ATTIC_SHARD, node="attic", tokens=2)]))

    removed = remove_attic(community, server.url)
    assert removed.exit_code == 0, removed.output
    # The first run put attic's addition before its removal on each stream (attic was added before the log).
    assert (f"its removal is at {SHARDS_STREAM} #4 (published by an earlier run), {PIPELINES_STREAM} #2 (published "
            "by an earlier run)") in removed.output
    cuts = {cut.stream: cut.seq for cut in community.roster().removed[0].cuts}
    assert cuts == {SHARDS_STREAM: 4, PIPELINES_STREAM: 2}
    assert community.roster().removed[0].removed_at < between_the_runs  # the removal began with the first run
    asyncio.run(publish_as_attic(server.url, seed_file, [heartbeat(ATTIC_SHARD, node="attic", tokens=3)]))
    after_the_removal = [(SHARDS_STREAM, 5, "removed_signer"), (SHARDS_STREAM, 6, "removed_signer")]
    live = tmp_path / "live.sqlite"
    upgrade_database(live)
    apply_new_messages(community, server.url, live, EventVerifier(RosterFile(community.roster_path),
                                                                  max_clock_skew_s=30))
    assert rejected(live) == after_the_removal

    # Retention drops the oldest messages, the first removal event with them: the roster's cut stands in for it.
    asyncio.run(as_steward(community, server.url, lambda js: js.purge_stream(SHARDS_STREAM, seq=5)))
    verifier = EventVerifier(Roster.load(community.roster_path), max_clock_skew_s=30)
    fresh = tmp_path / "fresh.sqlite"
    asyncio.run(as_auditor(community, server.url, lambda js: rebuild_database(js, fresh, verifier=verifier)))
    assert rejected(fresh) == after_the_removal
    report = asyncio.run(as_auditor(community, server.url, lambda js: verify_streams(js, verifier, ALL_STREAMS)))
    assert [(bad.stream, bad.seq, bad.reason) for bad in report.bad] == after_the_removal


def test_remove_with_a_stream_missing_says_so_in_one_line_at_once_and_changes_nothing(community_broker, caplog):
    community, server, _ = community_broker
    asyncio.run(as_steward(community, server.url, lambda js: js.delete_stream(PIPELINES_STREAM)))
    refused = remove_attic(community, server.url)
    assert refused.exit_code == 1, refused.output
    assert refused.output.startswith(f"hearth community remove: the event streams {PIPELINES_STREAM} do not exist on "
                                     f"{server.url}; the community's steward creates them: `hearth nats --community "
                                     "DIR` does when it starts")
    assert "nothing was changed" in refused.output and len(refused.output.strip().splitlines()) == 1
    # Refused before any publish (no retries against the missing stream), and nothing went into the other one.
    assert not [record for record in caplog.records if "publishing member.removed" in record.getMessage()]
    info = asyncio.run(as_steward(community, server.url, lambda js: js.stream_info(SHARDS_STREAM)))
    assert info.state.last_seq == 0
    assert community.roster().by_name("attic") is not None

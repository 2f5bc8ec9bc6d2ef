"""Reputation through a real community broker: an orchestrator's signed verification outcomes quarantine a shard in
a rebuilt read model, a forged clearing is rejected, the steward's `hearth community clear-quarantine` lifts it,
a live read model that applied the same messages equals the rebuild, and `hearth-replay shard` shows the evidence
(and, for another shard of the quarantined node, the quarantine that holds it)."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from hearth.events.envelope import utc_now
from hearth.events.publish import publish_event
from hearth.events.signing import EventVerifier
from hearth.events.streams import PIPELINES_STREAM
from hearth.readmodels.db import open_engine
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.tables import RejectedEvent, ShardReputation
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import NatsSettings
from hearth.services.community_cli import community_app
from hearth.services.community_reputation import quarantine_clearing
from hearth.services.replay.cli import app as replay_app
from tests.community_log import apply_new_messages, as_auditor, community_on_a_broker
from tests.readmodel_helpers import advertised
from tests.reputation_events import confirmed, verified
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey

pytestmark = pytest.mark.integration
runner = CliRunner()
KITCHEN, ATTIC, GARAGE = (advertised(0, 3, node).shard_id for node in ("kitchen-pc", "attic-pc", "garage-pc"))
GARAGE_INT8 = advertised(0, 3, "garage-pc", quantization="int8").shard_id  # the caught node under a new shard id


@pytest.fixture
def community_broker(tmp_path):
    with community_on_a_broker(tmp_path, (("hub", "orchestrator"), ("kitchen-pc", "shard"), ("garage-pc", "shard"),
                                          ("eve", "auditor"))) as (community, server):
        yield community, server


async def publish_as(community: Community, url: str, member: str, events) -> None:
    key_file = community.directory / "keys" / f"{member}.nk"
    connection = await connect_nats(url, name="test", settings=NatsSettings(url=url, creds_file=key_file))
    try:
        for event in events:
            await publish_event(connection.jetstream(), event, signing_key=MemberKey.load(key_file))
    finally:
        await connection.close()


def rebuild(community, url, path, verifier) -> None:
    asyncio.run(as_auditor(community, url, lambda js: rebuild_database(js, path, verifier=verifier)))


def status(path, shard_id: str) -> str:
    engine = open_engine(path)
    with Session(engine) as session:
        value = session.get(ShardReputation, shard_id).status
    engine.dispose()
    return value


def test_quarantine_and_clearing_through_a_community_broker(community_broker, tmp_path, monkeypatch):
    community, server = community_broker
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    # Dated now: the broker's storage time bounds occurred_at.
    outcomes = [event.model_copy(update={"occurred_at": utc_now()}) for event in (
        verified("p1", {KITCHEN: (2, 30), GARAGE: (1, 9)}), confirmed("p2", GARAGE, [KITCHEN, ATTIC]))]
    hub_key = MemberKey.load(community.directory / "keys" / "hub.nk")
    forged = quarantine_clearing(GARAGE, "the hub says so", hub_key).model_copy(update={"node_id": "hub"})
    asyncio.run(publish_as(community, server.url, "hub", [*outcomes, forged]))

    live = tmp_path / "live.sqlite"
    rebuild(community, server.url, live, verifier)
    assert status(live, GARAGE) == "quarantined" and status(live, KITCHEN) == "ok"
    engine = open_engine(live)
    with Session(engine) as session:
        [rejected] = session.query(RejectedEvent).all()
        assert (rejected.type, rejected.reason) == ("integrity.quarantine_cleared", "role_may_not_emit")
    engine.dispose()
    # As `--creds` would, through the environment (monkeypatch restores it for the tests that follow).
    monkeypatch.setenv("HEARTH_NATS__CREDS_FILE", str(community.directory / "keys" / "eve.nk"))
    held = runner.invoke(replay_app, ["shard", GARAGE_INT8, "--nats", server.url])
    assert held.exit_code == 0, held.output
    assert f"routing: node garage-pc quarantined (shard {GARAGE} mismatched)" in held.output

    cleared = runner.invoke(community_app, ["clear-quarantine", GARAGE, "--reason", "new GPU", "--dir",
                                            str(community.directory), "--db", str(live), "--nats", server.url])
    assert cleared.exit_code == 0, cleared.output
    apply_new_messages(community, server.url, live, verifier)
    assert status(live, GARAGE) == "ok"

    fresh = tmp_path / "fresh.sqlite"
    rebuild(community, server.url, fresh, verifier)
    assert diff_databases(fresh, live) == []

    shown = runner.invoke(replay_app, ["shard", GARAGE, "--nats", server.url])
    assert shown.exit_code == 0, shown.output
    assert "verification: status ok since" in shown.output
    assert "mismatch confirmed in pipeline p2 (reported by hub)" in shown.output
    assert "relative error 0.42 > tolerance 0.002" in shown.output
    assert "'new GPU'; lifted the quarantine" in shown.output
    assert "REJECTED integrity.quarantine_cleared" in shown.output and "(role_may_not_emit)" in shown.output


def test_a_clearing_with_its_stream_missing_says_so_in_one_line_before_any_publish(community_broker, tmp_path,
                                                                                   caplog):
    community, server = community_broker
    outcomes = [event.model_copy(update={"occurred_at": utc_now()}) for event in (
        verified("p1", {KITCHEN: (2, 30), GARAGE: (1, 9)}), confirmed("p2", GARAGE, [KITCHEN, ATTIC]))]
    asyncio.run(publish_as(community, server.url, "hub", outcomes))
    live = tmp_path / "live.sqlite"
    rebuild(community, server.url, live, EventVerifier(community.roster(), max_clock_skew_s=30))

    async def delete_pipelines(url: str) -> None:
        settings = NatsSettings(url=url, creds_file=community.system_key_path)
        connection = await connect_nats(url, name="test-steward", settings=settings)
        try:
            await connection.jetstream().delete_stream(PIPELINES_STREAM)
        finally:
            await connection.close()

    asyncio.run(delete_pipelines(server.url))
    refused = runner.invoke(community_app, ["clear-quarantine", GARAGE, "--reason", "new GPU", "--dir",
                                            str(community.directory), "--db", str(live), "--nats", server.url])
    assert refused.exit_code == 1, refused.output
    assert f"the event streams {PIPELINES_STREAM} do not exist on {server.url}" in refused.output
    assert "nothing was changed" in refused.output and len(refused.output.strip().splitlines()) == 1
    assert not [record for record in caplog.records if "publishing integrity.quarantine_cleared" in record.getMessage()]
